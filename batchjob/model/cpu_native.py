"""C++ kernels for float32 and bfloat16 on a CPU (csrc/): paged attention that reads the KV blocks where they lie
instead of gathering a copy per layer, and the decoder layer's elementwise ops fused into one pass each. Compiled with
torch.utils.cpp_extension on first use into the cache folder (once per source, torch and CPU); where that fails (no
compiler) or BATCHJOB_CPU_OPS=torch is set, `native_ops()` is None and the torch ops run instead (cpu_ops.py)."""

from __future__ import annotations

import hashlib
import logging
import threading
from pathlib import Path
from typing import Any

import torch

from batchjob import env
from batchjob.model.builtin import cache_dir
from batchjob.model.cpu_features import cpu_flags

log = logging.getLogger(__name__)

SOURCES = [Path(__file__).with_name("csrc") / name for name in ("paged_attention.cpp", "fused_ops.cpp")]
HEADERS = [Path(__file__).with_name("csrc") / "cpu_types.h"]  # included by the sources: part of the build's key
_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]  # fast-math: glibc's vector expf in the softmax
_lock = threading.Lock()
_state: dict[str, Any] = {}


def _build() -> Any:
    from torch.utils import cpp_extension

    # -march=native code is only valid on this CPU: the name keys the build on it as well as on sources and torch.
    parts = [p.read_text() for p in SOURCES + HEADERS] + [torch.__version__, cpu_flags(), *_FLAGS]
    key = hashlib.sha256(b"\0".join(s.encode() for s in parts)).hexdigest()[:12]
    name = f"batchjob_cpu_ops_{key}"
    build_dir = cache_dir() / "torch_extensions" / name
    build_dir.mkdir(parents=True, exist_ok=True)
    cpp_extension.load(
        name=name,
        sources=[str(p) for p in SOURCES],
        extra_cflags=_FLAGS,
        extra_ldflags=["-fopenmp"],
        build_directory=str(build_dir),
        is_python_module=False,
        verbose=False,
    )
    return torch.ops.batchjob_cpu


def native_ops() -> Any | None:
    """The ops namespace torch.ops.batchjob_cpu (paged_attention, rms_norm, add_rms_norm_, rotary_, store_kv,
    silu_and_mul), built on the first call; None where switched off or where it cannot be built (logged once)."""
    if (env.get("BATCHJOB_CPU_OPS") or "").lower() == "torch":
        return None
    if "ops" not in _state:
        with _lock:
            if "ops" not in _state:
                try:
                    _state["ops"] = _build()
                except Exception as e:  # a missing compiler or a failed build: the torch ops still work
                    log.warning("C++ CPU ops unavailable, using the torch ops: %s", str(e)[-800:])
                    _state["ops"] = None
    return _state["ops"]


def native_ops_for(device: torch.device, *dtypes: torch.dtype) -> Any | None:
    """The C++ ops where tensors of these dtypes on this device go to them (all float32, or all bfloat16, on a
    CPU), else None."""
    same = len(set(dtypes)) == 1 and dtypes[0] in (torch.float32, torch.bfloat16)
    return native_ops() if device.type == "cpu" and same else None
