"""The run side: executors (local and Ray), the run loop over committed parts, and signal handling."""
