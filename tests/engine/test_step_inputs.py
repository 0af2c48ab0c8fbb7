"""The vectorised step builder equals a per-token reference on random mixed steps (prefill chunks, decodes, rows
that do and do not sample)."""

from __future__ import annotations

import random

import torch

from batchjob.engine.outputs import Request
from batchjob.engine.sampling_params import SamplingParams
from batchjob.engine.scheduler import SchedulerOutput
from batchjob.engine.sequence import Sequence
from batchjob.engine.step_inputs import build_step_inputs


def random_step(rng: random.Random, block_size: int) -> SchedulerOutput:
    out = SchedulerOutput()
    free = list(range(1000))
    rng.shuffle(free)
    for i in range(rng.randint(1, 12)):
        seq = Sequence(Request(str(i), [rng.randrange(500) for _ in range(rng.randint(1, 90))], SamplingParams()), i)
        seq.token_ids += [rng.randrange(500) for _ in range(rng.randint(0, 20))]
        seq.num_computed_tokens = rng.randint(0, seq.num_tokens - 1)
        n = rng.randint(1, seq.num_tokens - seq.num_computed_tokens)  # a chunk, or all that is left
        seq.block_table = [free.pop() for _ in range(-(-(seq.num_computed_tokens + n) // block_size))]
        out.scheduled.append((seq, n))
    return out


def reference(out: SchedulerOutput, bs: int) -> dict:
    ids, positions, slots, qlens, seq_lens, rows = [], [], [], [], [], []
    for seq, n in out.scheduled:
        start = seq.num_computed_tokens
        ids += seq.token_ids[start : start + n]
        positions += range(start, start + n)
        slots += [seq.block_table[p // bs] * bs + p % bs for p in range(start, start + n)]
        qlens.append(n)
        seq_lens.append(start + n)
        if start + n == seq.num_tokens:
            rows.append(len(ids) - 1)
    width = max(len(s.block_table) for s, _ in out.scheduled)
    tables = [s.block_table + [-1] * (width - len(s.block_table)) for s, _ in out.scheduled]
    qsl = [0]
    for n in qlens:
        qsl.append(qsl[-1] + n)
    return dict(ids=ids, positions=positions, slots=slots, rows=rows, qsl=qsl, seq_lens=seq_lens, tables=tables)


def test_vectorised_step_equals_the_per_token_reference():
    rng = random.Random(0)
    for _ in range(50):
        bs = rng.choice([1, 4, 16])
        out = random_step(rng, bs)
        got, want = build_step_inputs(out, bs, torch.device("cpu")), reference(out, bs)
        m = got.meta
        assert got.input_ids.tolist() == want["ids"] and got.positions.tolist() == want["positions"]
        assert m.slot_mapping.tolist() == want["slots"] and got.sample_rows.tolist() == want["rows"]
        assert m.query_start_loc.tolist() == want["qsl"] and m.seq_lens.tolist() == want["seq_lens"]
        assert m.block_tables.tolist() == want["tables"] and m.block_tables.dtype == torch.int32
        assert m.query_lens_host == [n for _, n in out.scheduled] and m.seq_lens_host == want["seq_lens"]
        assert m.max_query_len == max(m.query_lens_host) and m.max_seq_len == max(want["seq_lens"])
