"""Host memory (engine/host_memory.py): the CPU KV pool zeroed, writable, committed only as written; freed
activations kept for reuse."""

from __future__ import annotations

import ctypes
import ctypes.util
import resource
from pathlib import Path

import torch

from batchjob.engine.host_memory import StepBlocks, keep_freed_memory, lazy_zeros


def test_lazy_zeros_is_a_zeroed_writable_tensor_of_the_shape():
    t = lazy_zeros((3, 16, 2, 8), torch.float32)
    assert t.shape == (3, 16, 2, 8) and t.dtype == torch.float32 and t.is_contiguous()
    assert not t.any()
    t[1, 2] = 7.0
    assert t.sum() == 7.0 * 16
    assert lazy_zeros((2, 4), torch.float8_e4m3fn).view(torch.uint8).sum() == 0


def _resident_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize()


def test_pages_are_committed_on_first_write_only():
    before = _resident_bytes()
    t = lazy_zeros((1024, 1024, 256), torch.float32)  # 1 GiB mapped
    t[0, 0, 0] = 1.0
    t[-1, -1, -1] = 1.0
    assert _resident_bytes() - before < 64 * 2**20  # two pages written, not a GiB
    t[:128].fill_(1.0)  # 128 MiB written: committed now
    assert _resident_bytes() - before > 100 * 2**20


def _faults_of_a_step() -> int:
    """Page faults while a step's worth of 24 MiB activations is allocated, written and freed ten times."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        torch.empty(2048, 3072).fill_(1.0)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_freed_activations_are_reused_without_page_faults():
    assert keep_freed_memory()  # glibc, as on every machine this project runs on (the pool's tests read /proc too)
    _faults_of_a_step()  # the first one grows the heap
    assert _faults_of_a_step() < 100  # each 24 MiB as a fresh mapping would fault ~6,000 pages in


_MALLINFO2_FIELDS = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"


class _MallInfo2(ctypes.Structure):  # glibc's struct mallinfo2: ten size_t
    _fields_ = [(name, ctypes.c_size_t) for name in _MALLINFO2_FIELDS.split()]


def _heap() -> _MallInfo2:
    """glibc's malloc statistics: `arena` the heap's size, `fordblks` its free bytes."""
    mallinfo2 = ctypes.CDLL(ctypes.util.find_library("c")).mallinfo2
    mallinfo2.restype = _MallInfo2
    return mallinfo2()


def _heap_growth(mib: int) -> int:
    """How much the heap grows while more `mib` MiB blocks than its free space holds are allocated together."""
    before = _heap()
    blocks = before.fordblks // (mib << 20) + 16
    held = [torch.empty(mib << 18) for _ in range(blocks)]
    growth = _heap().arena - before.arena
    del held
    return growth


def test_a_large_step_maps_its_large_blocks_afresh_and_a_small_one_keeps_them():
    """A step whose hidden states reach 4 MiB (here 2,048 tokens of 2,048 bytes) maps its blocks over 4 MiB afresh,
    given back when freed (kept in the heap, a 1B model's prefill activations fragmented it: 0.13 GiB more peak
    RSS); a decode-sized step allocates them in the heap, which keeps them for reuse."""
    blocks = StepBlocks(hidden_bytes_per_token=2048)
    assert blocks.enabled
    try:
        blocks.before_step(num_tokens=2048)
        assert _heap_growth(8) < 8 << 20
        blocks.before_step(num_tokens=16)
        assert _heap_growth(8) >= 16 * 8 << 20
    finally:
        blocks.before_step(num_tokens=0)
