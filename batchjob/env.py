"""Every environment variable batchjob reads, its default and meaning (docs/environment.md lists the same), and the
only functions that change the process environment.

`import batchjob` changes nothing: the CLI and the first use of `batchjob.Engine` call `configure_threads()`, and the
bench's peers get their settings through `scoped()`, which puts the old values back."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Variable:
    name: str
    default: str | None  # None: unset unless the user sets it
    meaning: str


VARIABLES = {
    v.name: v
    for v in (
        Variable(
            "BATCHJOB_CACHE",
            None,
            "Folder for converted models, the C++ kernels' build and input digests; default ~/.cache/batchjob.",
        ),
        Variable(
            "BATCHJOB_CPU_OPS",
            None,
            "`torch` runs the torch ops on a CPU instead of the C++ kernels (which are built on first use).",
        ),
        Variable(
            "BATCHJOB_CPU_ISA",
            None,
            "`avx2` runs as on an AVX2-only host (on an AVX-512 one, to measure that path): the C++ kernels built "
            "with -mno-avx512f, the avx512/amx flags hidden from batchjob's CPU-feature reads (dtype auto: float32), "
            "and oneDNN, MKL and ATen capped at AVX2 (ISA_CAPS) by configure_threads(), before torch loads.",
        ),
        Variable(
            "BATCHJOB_CPU_OPS_BUILD_WAIT",
            "300",
            "Seconds a run waits for another process's build of the C++ kernels before it runs the torch ops.",
        ),
        Variable(
            "OMP_WAIT_POLICY",
            "PASSIVE",
            "OpenMP threads sleep when idle: spinning ones slowed small matmuls many times over on a busy machine. "
            "Set by configure_threads() unless the user set it; read by the OpenMP runtime when torch loads.",
        ),
        Variable(
            "GOMP_SPINCOUNT",
            "3000",
            "Waits an idle OpenMP thread spins before it sleeps: a decode step runs ~300 parallel regions, so a short "
            "spin beats waking each time on an idle host. Set 0 on a shared machine. Set like OMP_WAIT_POLICY.",
        ),
        Variable(
            "TRITON_INTERPRET",
            None,
            "1 runs the Triton kernels in Triton's interpreter (on a CPU); read when the kernels are defined.",
        ),
        Variable(
            "VLLM_CPU_NUM_OF_RESERVED_CPU",
            "0",
            "Given to vLLM-CPU by `batchjob bench` while it starts (its default reserves a core of two for itself).",
        ),
    )
}
OPENMP = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
# Per BATCHJOB_CPU_ISA value: the libraries' own switches that keep them to that ISA, read when they first run.
ISA_CAPS = {"avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}}
_set_here: set[str] = set()  # the names configure_threads set, not the user
_warned: set[str] = set()  # BATCHJOB_CPU_ISA values already warned about


def get(name: str) -> str | None:
    """The variable's value, or its default; only registered names."""
    return os.environ.get(name, VARIABLES[name].default)


def cpu_isa() -> str | None:
    """BATCHJOB_CPU_ISA: "avx2", or None (the CPU's own, also for a value it does not know, with a warning)."""
    value = (get("BATCHJOB_CPU_ISA") or "").lower() or None
    if value is not None and value not in ISA_CAPS:
        if value not in _warned:
            _warned.add(value)
            logging.getLogger(__name__).warning(
                "BATCHJOB_CPU_ISA=%r is not one of %s; using the CPU's own instructions", value, ", ".join(ISA_CAPS)
            )
        return None
    return value


def configure_threads(num_threads: int | None = None) -> bool:
    """The process's thread settings, in one place: the OpenMP variables' defaults where the user has not set them,
    and BATCHJOB_CPU_ISA's caps on the libraries (ISA_CAPS), then, with `num_threads` (the engine's setting), torch's
    intra-op thread count. True when the variables were in time to take effect: the OpenMP runtime reads them once,
    when torch is first imported."""
    in_time = "torch" not in sys.modules
    if in_time:
        for name in OPENMP:
            if name not in os.environ:
                os.environ[name] = VARIABLES[name].default
                _set_here.add(name)
        for name, value in ISA_CAPS.get(cpu_isa() or "", {}).items():
            os.environ.setdefault(name, value)
    if num_threads is not None:
        import torch

        torch.set_num_threads(num_threads)
    return in_time


def set_here() -> dict[str, None]:
    """The variables configure_threads set, as `scoped` values that unset them: a peer started from the bench runs
    with its own defaults, not ours."""
    return dict.fromkeys(_set_here)


@contextlib.contextmanager
def scoped(values: dict[str, str | None]) -> Iterator[None]:
    """Set `values` (None: unset) for the body, e.g. while a peer starts its workers, then restore what was there."""
    before = {k: os.environ.get(k) for k in values}
    _apply(values)
    try:
        yield
    finally:
        _apply(before)


def _apply(values: dict[str, str | None]) -> None:
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def use_triton_interpreter() -> None:
    """Run the Triton kernels in the interpreter (on a CPU): only possible before they are defined."""
    if get("TRITON_INTERPRET") == "1":
        return
    if any(m.startswith("batchjob.kernels.") for m in sys.modules):
        raise RuntimeError("the Triton kernels were imported without TRITON_INTERPRET=1; set it before importing them")
    os.environ["TRITON_INTERPRET"] = "1"
