"""A scheduled step's model inputs, built with numpy over whole arrays (no Python loop per token) and moved to the
device in one copy: every integer field is packed into one host buffer (pinned on a GPU, copied non-blocking), so
preparing a step costs one host-to-device transfer and no synchronisation.

A decode step can also be padded to a fixed shape (a CUDA graph's, see decode_graphs.py): more rows, each a one-token
sequence that writes and reads a KV block no sequence owns, and block tables of a fixed width."""

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


@dataclass(frozen=True)
class Padding:
    num_seqs: int  # rows of the padded step, one per sequence (a decode step has one token per sequence)
    table_width: int  # blocks per block-table row
    pad_block: int  # the KV block that padding rows write and read


@dataclass
class PackedStep:
    """The host buffer: ids | positions | slots | query_start_loc | seq_lens | block tables | sample rows. The
    sample rows come last, so that padded steps of one shape share the offsets of every field a forward pass reads."""

    host: torch.Tensor  # int64
    sizes: list[int]
    table_width: int
    query_lens: list[int]
    seq_lens: list[int]

    def unpack(self, buf: torch.Tensor) -> StepInputs:
        """The step's tensors as views of `buf` (the host buffer, or its copy on the device)."""
        ids, pos, slots, qsl, lens, tables, rows = torch.split(buf[: sum(self.sizes)], self.sizes)
        meta = AttentionMetadata(
            query_start_loc=qsl.to(torch.int32),
            seq_lens=lens.to(torch.int32),
            block_tables=tables.view(len(self.seq_lens), self.table_width).to(torch.int32),
            slot_mapping=slots,
            max_query_len=max(self.query_lens),
            max_seq_len=max(self.seq_lens),
            query_lens_host=self.query_lens,
            seq_lens_host=self.seq_lens,
        )
        return StepInputs(ids, pos, meta, rows)

    def sample_rows(self, buf: torch.Tensor) -> torch.Tensor:
        start = sum(self.sizes[:-1])
        return buf[start : start + self.sizes[-1]]


def pack_step(out: SchedulerOutput, block_size: int, pad: Padding | None = None, pinned: bool = False) -> PackedStep:
    scheduled = out.scheduled
    n = len(scheduled)
    b = pad.num_seqs if pad else n
    # Padding rows: one token at position 0 (start 0, length 1) that never samples (num_tokens 0).
    starts, qlens, num_tokens = np.zeros(b, np.int64), np.ones(b, np.int64), np.zeros(b, np.int64)
    starts[:n] = np.fromiter((seq.num_computed_tokens for seq, _ in scheduled), np.int64, n)
    qlens[:n] = np.fromiter((k for _, k in scheduled), np.int64, n)
    num_tokens[:n] = np.fromiter((seq.num_tokens for seq, _ in scheduled), np.int64, n)
    seq_lens = starts + qlens
    qsl = np.zeros(b + 1, np.int64)
    np.cumsum(qlens, out=qsl[1:])
    total, real = int(qsl[-1]), int(qsl[n])
    width = pad.table_width if pad else max(len(seq.block_table) for seq, _ in scheduled)
    # the last row of each sequence whose tokens are all computed, unless it draws none (prompt_only)
    draws = np.zeros(b, bool)
    draws[:n] = np.fromiter((not seq.prompt_only for seq, _ in scheduled), bool, n)
    sample_rows = (qsl[1:] - 1)[(seq_lens == num_tokens) & draws]

    sizes = [total, total, total, b + 1, b, b * width, len(sample_rows)]
    host = torch.empty(sum(sizes), dtype=torch.int64, pin_memory=pinned)
    ids, pos, slots, qsl_h, lens_h, tables, rows = np.split(host.numpy(), np.cumsum(sizes)[:-1])
    ids[:real] = np.fromiter(
        itertools.chain.from_iterable(seq.token_ids[s : s + k] for (seq, k), s in zip(scheduled, starts.tolist())),
        np.int64,
        real,
    )
    ids[real:] = 0
    owner = np.repeat(np.arange(b), qlens)  # the sequence of each row
    pos[:] = np.arange(total) - np.repeat(qsl[:-1] - starts, qlens)
    tables = tables.reshape(b, width)
    tables.fill(-1)
    for i, (seq, _) in enumerate(scheduled):  # one slice assignment per sequence
        tables[i, : len(seq.block_table)] = seq.block_table
    if pad:
        tables[n:, 0] = pad.pad_block
    slots[:] = tables[owner, pos // block_size] * block_size + pos % block_size
    rows[:], qsl_h[:], lens_h[:] = sample_rows, qsl, seq_lens
    return PackedStep(host, sizes, width, qlens.tolist(), seq_lens.tolist())


def build_step_inputs(out: SchedulerOutput, block_size: int, device: torch.device) -> StepInputs:
    pinned = device.type == "cuda"
    packed = pack_step(out, block_size, pinned=pinned)
    return packed.unpack(packed.host.to(device, non_blocking=True) if pinned else packed.host)
