"""batchjob: offline LLM batch inference with continuous batching and resumable Parquet output."""
import os

# Must precede torch's import: spinning OpenMP threads slowed small matmuls 10x on a busy 2-core machine.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
