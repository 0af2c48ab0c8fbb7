"""What a running job tells: progress lines, the step timeline, Prometheus metrics and the report."""
