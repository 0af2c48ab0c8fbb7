"""batchjob: offline LLM batch inference with continuous batching and resumable Parquet output.

`from batchjob import Engine, SamplingParams` works as `from vllm import LLM, SamplingParams` does; the names are
loaded on first use, so `import batchjob` (and the CLI's start-up) does not import torch."""

import os

# Must precede torch's import: spinning OpenMP threads slowed small matmuls 10x on a busy 2-core machine.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
__all__ = ["Engine", "SamplingParams", "RequestOutput"]


def __getattr__(name: str):
    if name in __all__:
        from batchjob import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'batchjob' has no attribute {name!r}")
