"""A batch of token-id lists laid end to end, no padding, as the embedding models read it: built on the host and
moved to the model's device in one copy."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate, chain

import torch


@dataclass(frozen=True)
class PackedBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]: each token's position in its own sequence
    cu_seqlens: torch.Tensor  # [S + 1] int32: the row where each sequence starts, and the end
    prompt_lengths: torch.Tensor  # [S]: how many of each sequence's first tokens are a prompt's
    seq_lens: list[int]  # on the host

    @classmethod
    def build(
        cls, batch: list[list[int]], device: torch.device | str = "cpu", prompt_lengths: list[int] | None = None
    ) -> PackedBatch:
        lens = [len(ids) for ids in batch]
        cu_seqlens = [0, *accumulate(lens)]
        t, s = cu_seqlens[-1], len(batch)
        values = chain(chain.from_iterable(batch), chain.from_iterable(map(range, lens)), cu_seqlens)
        host = torch.tensor([*values, *(prompt_lengths or [0] * s)])
        on_device = host.to(device)
        return cls(
            input_ids=on_device[:t],
            positions=on_device[t : 2 * t],
            cu_seqlens=on_device[2 * t : 2 * t + s + 1].to(torch.int32),
            prompt_lengths=on_device[2 * t + s + 1 :],
            seq_lens=lens,
        )
