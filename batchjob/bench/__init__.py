"""Measurement, kept out of the core: `batchjob bench` (workloads, systems, roofline) and `batchjob selftest`."""
