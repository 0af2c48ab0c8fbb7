"""Host memory (engine/host_memory.py): the CPU KV pool zeroed, writable, committed only as written; freed
activations kept for reuse."""

from __future__ import annotations

import resource
from pathlib import Path

import torch

from batchjob.engine.host_memory import keep_freed_memory, lazy_zeros


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
