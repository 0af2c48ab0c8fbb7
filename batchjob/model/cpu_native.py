"""C++ kernels for float32 and bfloat16 on a CPU (csrc/): paged attention that reads the KV blocks where they lie
instead of gathering a copy per layer, and the decoder layer's elementwise ops fused into one pass each. Compiled with
torch.utils.cpp_extension on first use into the cache folder (once per source, torch and CPU); where that fails (no
compiler) or BATCHJOB_CPU_OPS=torch is set, `native_ops()` is None and the torch ops run instead (cpu_ops.py).

A build cannot wedge later runs: it holds an flock of ours, which dies with its holder (torch's own lock file outlives
a kill -9, and every later build waited on it forever), and builds in a temporary folder renamed into place when
whole. So a folder under its final name always holds a whole build, which later runs load directly, with no lock and
no ninja. A run that finds another one building waits BATCHJOB_CPU_OPS_BUILD_WAIT seconds at most, then runs the
torch ops."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch

from batchjob import env
from batchjob.model.build_lock import build_lock
from batchjob.model.builtin import cache_dir
from batchjob.model.cpu_features import cpu_flags

log = logging.getLogger(__name__)

SOURCES = [
    Path(__file__).with_name("csrc") / name
    for name in ("paged_attention.cpp", "fused_ops.cpp", "bf16_dot.cpp", "gguf_matmul.cpp")
]
HEADERS = [Path(__file__).with_name("csrc") / "cpu_types.h"]  # included by the sources: part of the build's key
_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]  # fast-math: glibc's vector expf in the softmax
_ISA_FLAGS = {"avx2": ["-mno-avx512f"]}  # BATCHJOB_CPU_ISA: -march=native less AVX-512 (all its subsets go with F)
_lock = threading.Lock()
_state: dict[str, Any] = {}


def build_paths() -> tuple[Path, Path]:
    """The folder that holds a whole build and the lock file its builders hold. The name keys the build on the
    sources and the header they include, torch, the flags and this CPU (-march=native code is only valid on it)."""
    parts = [p.read_text() for p in SOURCES + HEADERS] + [torch.__version__, cpu_flags(), *compiler_flags()]
    key = hashlib.sha256(b"\0".join(s.encode() for s in parts)).hexdigest()[:12]
    name = f"batchjob_cpu_ops_{key}"
    root = cache_dir() / "cpu_ops"
    return root / name, root / f"{name}.lock"


def compiler_flags() -> list[str]:
    return _FLAGS + _ISA_FLAGS.get(env.cpu_isa() or "", [])


def _load() -> Any:
    folder, lock_path = build_paths()
    library = folder / f"{folder.name}.so"
    if not library.exists():
        folder.parent.mkdir(parents=True, exist_ok=True)
        with build_lock(lock_path, _build_wait(), "the C++ CPU kernels", "BATCHJOB_CPU_OPS_BUILD_WAIT"):
            if not library.exists():  # else another process built it while this one waited
                _build(folder)
                return torch.ops.batchjob_cpu  # cpp_extension.load loaded it
    torch.ops.load_library(str(library))
    return torch.ops.batchjob_cpu


def _build_wait() -> float:
    value = env.get("BATCHJOB_CPU_OPS_BUILD_WAIT")
    try:
        return float(value)
    except ValueError:
        default = env.VARIABLES["BATCHJOB_CPU_OPS_BUILD_WAIT"].default
        log.warning("BATCHJOB_CPU_OPS_BUILD_WAIT=%r is not a number of seconds; waiting %s s", value, default)
        return float(default)


def _build(folder: Path) -> None:
    """Build into a temporary folder beside `folder`, load the library from there and rename the folder into place.
    Runs under the build lock, so any other temporary folder for this build is a killed build's."""
    from torch.utils import cpp_extension

    # Logged as a warning: the one level a user sees without logging configured, and the first run is slow.
    log.warning("building the C++ CPU kernels (first use; about a minute of CPU) into %s", folder)
    for stale in folder.parent.glob(f"{folder.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{folder.name}.tmp-", dir=folder.parent))
    try:
        tmp.chmod(0o755)  # as a plain mkdir makes it, not mkdtemp's 0700
        with env.scoped({"PATH": _build_path()}):
            cpp_extension.load(
                name=folder.name,
                sources=[str(p) for p in SOURCES],
                extra_cflags=compiler_flags(),
                extra_ldflags=["-fopenmp"],
                build_directory=str(tmp),
                is_python_module=False,
                verbose=False,
            )
        shutil.rmtree(folder, ignore_errors=True)  # a folder whose library someone deleted: rename needs it gone
        tmp.rename(folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _build_path() -> str:
    """PATH for the build, with the ninja package's bin folder and this Python's first: cron's PATH lacks the venv's
    bin, and a system ninja of another version is not the one installed with batchjob (its own folder goes first:
    the Python may be a system one, beside a system ninja)."""
    import ninja

    folders = [ninja.BIN_DIR, os.path.dirname(sys.executable), *os.environ.get("PATH", "").split(os.pathsep)]
    return os.pathsep.join(dict.fromkeys(f for f in folders if f))


def native_ops() -> Any | None:
    """The ops namespace torch.ops.batchjob_cpu (paged_attention, rms_norm, add_rms_norm_, rotary_, store_kv,
    silu_and_mul), built on the first call; None where switched off or where it cannot be built (logged once)."""
    if (env.get("BATCHJOB_CPU_OPS") or "").lower() == "torch":
        return None
    if "ops" not in _state:
        with _lock:
            if "ops" not in _state:
                try:
                    _state["ops"] = _load()
                except Exception as e:  # no compiler, a failed build, another build past the wait: torch's ops work
                    log.warning("C++ CPU ops unavailable, using the torch ops: %s", str(e)[-800:])
                    _state["ops"] = None
    return _state["ops"]


def native_ops_for(device: torch.device, *dtypes: torch.dtype) -> Any | None:
    """The C++ ops where tensors of these dtypes on this device go to them (all float32, or all bfloat16, on a
    CPU), else None."""
    same = len(set(dtypes)) == 1 and dtypes[0] in (torch.float32, torch.bfloat16)
    return native_ops() if device.type == "cpu" and same else None
