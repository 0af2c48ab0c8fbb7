"""Paged attention in C++ for a CPU (csrc/paged_attention.cpp): it reads the KV blocks where they lie instead of
gathering a copy per layer, for all sequences of a step in one call. Compiled with torch.utils.cpp_extension on first
use into the cache folder (once per source, torch and CPU); where that fails (no compiler) or
BATCHJOB_CPU_ATTENTION=torch is set, `native_op()` is None and ops.paged_attention keeps its torch path."""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from batchjob.model.builtin import cache_dir

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "paged_attention.cpp"
ENV = "BATCHJOB_CPU_ATTENTION"  # "torch" forces the torch path
_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]  # fast-math: glibc's vector expf in the softmax
_lock = threading.Lock()
_state: dict[str, Callable | None] = {}


def _cpu_flags() -> str:
    try:
        return next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return platform.processor()


def _build() -> Callable:
    from torch.utils import cpp_extension

    # -march=native code is only valid on this CPU: the name keys the build on it as well as on source and torch.
    key = hashlib.sha256(
        b"\0".join(s.encode() for s in (SOURCE.read_text(), torch.__version__, _cpu_flags(), *_FLAGS))
    ).hexdigest()[:12]
    name = f"batchjob_cpu_attention_{key}"
    build_dir = cache_dir() / "torch_extensions" / name
    build_dir.mkdir(parents=True, exist_ok=True)
    cpp_extension.load(
        name=name,
        sources=[str(SOURCE)],
        extra_cflags=_FLAGS,
        extra_ldflags=["-fopenmp"],
        build_directory=str(build_dir),
        is_python_module=False,
        verbose=False,
    )
    return torch.ops.batchjob_cpu.paged_attention


def native_op() -> Callable | None:
    """torch.ops.batchjob_cpu.paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale),
    built on the first call; None where it is switched off or cannot be built (logged once)."""
    if os.environ.get(ENV, "").lower() == "torch":
        return None
    if "op" not in _state:
        with _lock:
            if "op" not in _state:
                try:
                    _state["op"] = _build()
                except Exception as e:  # a missing compiler or a failed build: the torch path still works
                    log.warning("C++ CPU attention unavailable, using the torch path: %s", str(e)[-800:])
                    _state["op"] = None
    return _state["op"]


def native_op_for(device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype) -> Callable | None:
    """The op where paged attention with these queries and this KV cache goes to it (fp32 on a CPU), else None."""
    return native_op() if device.type == "cpu" and dtype == kv_dtype == torch.float32 else None
