"""The engine layer: continuous batching over a paged KV cache (scheduler, block manager, sampler, model runner).

It imports only `batchjob.model` and `batchjob.kernels`. `Engine` and `Embedder` are loaded on first use, so the job
layer can import `SamplingParams` and the output types without importing torch."""

from batchjob.engine.outputs import RequestOutput
from batchjob.engine.sampling_params import SamplingParams
from batchjob.env import configure_threads

__all__ = ["Embedder", "Engine", "RequestOutput", "SamplingParams"]


def __getattr__(name: str):
    if name == "Engine":
        configure_threads()  # before torch loads, which the engine module imports

        from batchjob.engine.engine import Engine

        return Engine
    if name == "Embedder":
        configure_threads()

        from batchjob.engine.embedder import Embedder

        return Embedder
    raise AttributeError(f"module 'batchjob.engine' has no attribute {name!r}")
