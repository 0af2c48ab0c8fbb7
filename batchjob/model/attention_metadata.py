"""What one forward pass needs to read and write the paged KV cache."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    """Sequences are packed back to back in the step: sequence i owns query rows
    query_start_loc[i]:query_start_loc[i+1], which are the last rows of its context of seq_lens[i] tokens."""

    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32, context length including this step's tokens
    block_tables: torch.Tensor  # [B, max_blocks] int32, -1 padded
    slot_mapping: torch.Tensor  # [T] int64, cache slot of each query row's K/V
    max_query_len: int
    max_seq_len: int
    # Host copies, so that the CPU path can plan without device syncs.
    query_lens_host: list[int]
    seq_lens_host: list[int]
    # What an attention backend derives from the fields above once per step, for all layers, by its own key.
    plan_cache: dict = field(default_factory=dict, repr=False)

    @classmethod
    def build(
        cls, query_lens: list[int], seq_lens: list[int], block_tables, slot_mapping, device: torch.device | str = "cpu"
    ) -> AttentionMetadata:
        """From host lists; block_tables and slot_mapping may be lists or tensors."""
        qsl = [0]
        for n in query_lens:
            qsl.append(qsl[-1] + n)
        return cls(
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=torch.as_tensor(block_tables, dtype=torch.int32).to(device),
            slot_mapping=torch.as_tensor(slot_mapping, dtype=torch.long).to(device),
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
            query_lens_host=list(query_lens),
            seq_lens_host=list(seq_lens),
        )

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)
