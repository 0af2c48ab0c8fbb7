"""A scheduled step's model inputs, built with numpy over whole arrays (no Python loop per token) and moved to the
device in one copy: every integer field is packed into one host buffer (pinned on a GPU, copied non-blocking), so
preparing a step costs one host-to-device transfer and no synchronisation."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from batchjob.engine.scheduler import SchedulerOutput
from batchjob.model.attention_metadata import AttentionMetadata


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # [S] int64: rows whose sequence has all its tokens computed and needs the next one

    @property
    def num_samples(self) -> int:
        return self.sample_rows.shape[0]


def build_step_inputs(out: SchedulerOutput, block_size: int, device: torch.device) -> StepInputs:
    scheduled = out.scheduled
    b = len(scheduled)
    starts = np.fromiter((seq.num_computed_tokens for seq, _ in scheduled), np.int64, b)
    qlens = np.fromiter((n for _, n in scheduled), np.int64, b)
    num_tokens = np.fromiter((seq.num_tokens for seq, _ in scheduled), np.int64, b)
    seq_lens = starts + qlens
    qsl = np.zeros(b + 1, np.int64)
    np.cumsum(qlens, out=qsl[1:])
    total = int(qsl[-1])
    max_blocks = max(len(seq.block_table) for seq, _ in scheduled)
    sample_rows = (qsl[1:] - 1)[seq_lens == num_tokens]

    # One int64 buffer: ids | positions | slots | sample rows | query_start_loc | seq_lens | block tables.
    sizes = [total, total, total, len(sample_rows), b + 1, b, b * max_blocks]
    pinned = device.type == "cuda"
    host = torch.empty(sum(sizes), dtype=torch.int64, pin_memory=pinned)
    ids, pos, slots, rows, qsl_h, lens_h, tables = np.split(host.numpy(), np.cumsum(sizes)[:-1])
    ids[:] = np.fromiter(
        itertools.chain.from_iterable(seq.token_ids[s : s + n] for (seq, n), s in zip(scheduled, starts.tolist())),
        np.int64,
        total,
    )
    owner = np.repeat(np.arange(b), qlens)  # the sequence of each row
    pos[:] = np.arange(total) - np.repeat(qsl[:-1] - starts, qlens)
    tables = tables.reshape(b, max_blocks)
    tables.fill(-1)
    for i, (seq, _) in enumerate(scheduled):  # one slice assignment per sequence
        tables[i, : len(seq.block_table)] = seq.block_table
    slots[:] = tables[owner, pos // block_size] * block_size + pos % block_size
    rows[:], qsl_h[:], lens_h[:] = sample_rows, qsl, seq_lens

    dev = host.to(device, non_blocking=True) if pinned else host
    d_ids, d_pos, d_slots, d_rows, d_qsl, d_lens, d_tables = torch.split(dev, sizes)
    meta = AttentionMetadata(
        query_start_loc=d_qsl.to(torch.int32),
        seq_lens=d_lens.to(torch.int32),
        block_tables=d_tables.view(b, max_blocks).to(torch.int32),
        slot_mapping=d_slots,
        max_query_len=int(qlens.max()),
        max_seq_len=int(seq_lens.max()),
        query_lens_host=qlens.tolist(),
        seq_lens_host=seq_lens.tolist(),
    )
    return StepInputs(d_ids, d_pos, meta, d_rows)
