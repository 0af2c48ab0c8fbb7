"""Sizing the KV pool on a GPU: kv_cache_memory_fraction of the device's memory, less what torch's caching allocator
holds besides the pool, measured by running on a scratch cache, before the pool exists, the steps it stands for:
  - the largest step (a prefill over the full token budget): the weights, its activations, workspaces;
  - with CUDA graphs, the padded body of the largest graph batch. The graphs are captured after the pool is
    allocated, into a memory pool of their own that no other step reuses, so their temporaries count apart; the
    body run eagerly allocates what its capture will.
Figures are what the allocator reserves, not what tensors occupy, so that its rounding counts. The CUDA context and
the graphs' own executable state (a few hundred MiB) are outside them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from batchjob.engine.errors import DeviceSettingError


@dataclass(frozen=True)
class MemoryProfile:
    total: int  # the device's memory, bytes
    step_peak: int  # reserved at the largest step, the scratch cache taken out
    graph_pool: int  # reserved by the padded body of the largest graph batch; 0 without graphs

    def kv_budget(self, fraction: float) -> int:
        """Bytes left for the KV pool; raises, naming the figures, when nothing is."""
        budget = int(self.total * fraction) - self.step_peak - self.graph_pool
        if budget <= 0:
            gib = 2**30
            raise DeviceSettingError(
                f"kv_cache_memory_fraction {fraction} of {self.total / gib:.1f} GiB leaves no room for the KV cache "
                f"after the weights and the largest step ({self.step_peak / gib:.2f} GiB) and the CUDA graphs' "
                f"pool ({self.graph_pool / gib:.2f} GiB): raise it, or lower max_num_batched_tokens or max_num_seqs"
            )
        return budget


def reserved_peak(device: torch.device, run: Callable[[], object]) -> tuple[int, int]:
    """Bytes torch's allocator holds on `device` before `run` (its cached free blocks handed back first, so that the
    growth is what a fresh pool needs) and at run's peak."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_reserved(device)
    run()
    torch.cuda.synchronize(device)
    return before, torch.cuda.max_memory_reserved(device)
