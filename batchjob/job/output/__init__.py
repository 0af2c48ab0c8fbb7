"""The output folder: storage and atomic writes, the result schema, part files, run state, locks and leases."""
