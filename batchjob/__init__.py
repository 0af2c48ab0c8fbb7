"""batchjob: offline LLM batch inference with continuous batching and resumable Parquet output.

`from batchjob import Engine, SamplingParams` works as `from vllm import LLM, SamplingParams` does; the names are
loaded on first use, so `import batchjob` (and the CLI's start-up) does not import torch, and changes no environment
variable: the first use of `Engine` applies the OpenMP settings (`configure_threads`, batchjob/env.py)."""

import importlib

from batchjob.env import configure_threads

__version__ = "0.1.0"
# What `batchjob.run_job` raises where `batchjob run` would exit with one line (docs/python-api.md), by module.
_ERRORS = {
    "JobFileError": "batchjob.job.spec",
    "InputError": "batchjob.job.input.reader",
    "StateError": "batchjob.job.output.state",
    "LockHeld": "batchjob.job.output.lock",
    "ModelError": "batchjob.model.errors",
}
__all__ = [
    "Embedder",
    "Engine",
    "SamplingParams",
    "RequestOutput",
    "configure_threads",
    "run_job",
    "JobResult",
    *_ERRORS,
]


def __getattr__(name: str):
    if name in ("Embedder", "Engine", "SamplingParams", "RequestOutput"):
        from batchjob import engine

        return getattr(engine, name)
    if name == "run_job":  # `batchjob run` from Python (batchjob/job/api.py)
        from batchjob.job.api import run

        return run
    if name == "JobResult":
        from batchjob.job.api import JobResult

        return JobResult
    if name in _ERRORS:
        return getattr(importlib.import_module(_ERRORS[name]), name)
    raise AttributeError(f"module 'batchjob' has no attribute {name!r}")
