"""batchjob: offline LLM batch inference with continuous batching and resumable Parquet output.

`from batchjob import Engine, SamplingParams` works as `from vllm import LLM, SamplingParams` does; the names are
loaded on first use, so `import batchjob` (and the CLI's start-up) does not import torch."""

import os

# Must precede torch's import: spinning OpenMP threads slowed small matmuls 10x on a busy 2-core machine. Yet a
# thread that sleeps as soon as a parallel region ends is woken for the next one, and a decode step runs ~300 of
# them: a short spin first (libgomp's count of waits) took 64 x 256 / 64 decode-only steps from 9.0-9.4 s to
# 8.0-8.1 on an idle host, while with another process busy on a core the run was 5 % slower than without it
# (README, "Threads"). Set GOMP_SPINCOUNT=0 on a shared machine.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("GOMP_SPINCOUNT", "3000")

__version__ = "0.1.0"
__all__ = ["Engine", "SamplingParams", "RequestOutput"]


def __getattr__(name: str):
    if name in __all__:
        from batchjob import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'batchjob' has no attribute {name!r}")
