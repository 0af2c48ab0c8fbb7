"""Host memory on a CPU: the KV pool, zeroed lazily in small pages; freed activations kept for reuse; the process's
peak resident memory.

A GiB-sized pool written up front costs start-up time and commits all of it at once, so it is mapped lazily: a page is
committed on its first write. numpy's zeros did that, but asks the kernel for transparent huge pages on large arrays,
and a huge-page fault may stall on memory compaction: a first pass over a GiB-sized pool took many times longer in
huge-page faults than in 4 KiB ones. The mapping here declines huge
pages (MADV_NOHUGEPAGE), so a first write never waits on compaction."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import math
import mmap
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor whose pages are committed on first write."""
    import torch  # here: the job layer reads peak_rss without importing torch (batchjob's API imports none)

    nbytes = math.prod(shape) * dtype.itemsize
    buf = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):  # Linux only; elsewhere the OS's default pages
        with contextlib.suppress(OSError):  # a kernel without THP support: its pages are small already
            buf.madvise(mmap.MADV_NOHUGEPAGE)
    # frombuffer holds a reference to the mapping, which so lives as long as the tensor.
    return torch.frombuffer(buf, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
KEPT_BLOCK_BYTES = 32 << 20  # the largest block malloc keeps for reuse (keep_freed_memory): larger ones fault anew
# The largest block kept through a step whose hidden states reach it (a long prefill chunk of a 1B-class model)
LARGE_STEP_BLOCK_BYTES = 4 << 20


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c"))
    except OSError:  # no C library found
        return None


def _mallopt(param: int, value: int) -> bool:
    libc = _libc()
    try:
        return libc is not None and bool(libc.mallopt(param, value))
    except (AttributeError, TypeError):  # a C library without mallopt (musl, macOS)
        return False


def keep_freed_memory() -> bool:
    """Asks glibc's malloc to keep freed blocks of up to 32 MiB (its maximum) in the heap, and the heap's top,
    rather than give them back to the OS. A CPU step allocates and frees each layer's activations (tens of MB at
    2,048 rows), and by default each large one was a fresh mapping whose pages fault in again, every step. False
    where the C library is not glibc."""
    return _mallopt(_M_MMAP_THRESHOLD, KEPT_BLOCK_BYTES) and _mallopt(_M_TRIM_THRESHOLD, 1 << 30)


class StepBlocks:
    """Which freed blocks malloc keeps, chosen before each CPU step by the size of its hidden states.

    Kept blocks pay in steps of small blocks: a decode step's logits and the sampler's [rows, vocabulary] temporaries
    (Qwen3-0.6B's shape, 16 rows: 8-17 % slower with fresh mappings), a 135M model's prefill (3 % slower). In a step
    whose hidden states reach 4 MiB (2,048 prompt tokens of a 1B model) the kept blocks of the layers' activations
    fragmented the heap: 1B Q8_0, 16 x 128 -> 128, peak RSS 1.81 GiB with them and 1.68 without, its speed the same.
    So such a step's blocks over 4 MiB are fresh mappings, given back when freed."""

    def __init__(self, hidden_bytes_per_token: int):
        self.hidden_bytes_per_token = hidden_bytes_per_token
        self.enabled = keep_freed_memory()
        self.max_block = KEPT_BLOCK_BYTES

    def before_step(self, num_tokens: int) -> None:
        large = num_tokens * self.hidden_bytes_per_token >= LARGE_STEP_BLOCK_BYTES
        max_block = LARGE_STEP_BLOCK_BYTES if large else KEPT_BLOCK_BYTES
        if self.enabled and max_block != self.max_block:
            self.max_block = max_block if _mallopt(_M_MMAP_THRESHOLD, max_block) else self.max_block


def reset_peak_rss() -> None:
    """Start this process's peak RSS (VmHWM) afresh from its present RSS (Linux's clear_refs; elsewhere a no-op)."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def _status_bytes(pid: int | str, field: str) -> int | None:
    """A size line of a process's /proc status (VmHWM, VmRSS) in bytes, or None where /proc does not say."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    kb = next((line.split()[1] for line in status.splitlines() if line.startswith(field + ":")), None)
    return None if kb is None else int(kb) * 1024


def peak_rss(pid: int | str = "self") -> int | None:
    """A process's peak resident memory in bytes since it started or since reset_peak_rss (VmHWM), or None where
    /proc does not say."""
    return _status_bytes(pid, "VmHWM")


def resident_bytes(pid: int | str = "self") -> int | None:
    """A process's resident memory in bytes now (VmRSS), or None where /proc does not say."""
    return _status_bytes(pid, "VmRSS")


def available_memory() -> int | None:
    """Bytes the host can give without swapping (MemAvailable), or None where /proc does not say."""
    try:
        meminfo = Path("/proc/meminfo").read_text()
    except OSError:
        return None
    kb = next((line.split()[1] for line in meminfo.splitlines() if line.startswith("MemAvailable:")), None)
    return None if kb is None else int(kb) * 1024
