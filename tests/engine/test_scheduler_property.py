"""Scheduler and block manager under random workloads, with a fake model (random tokens, no forward pass):
limits are never exceeded, no block leaks or is freed twice, and every request finishes."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from batchjob.engine.block_manager import BlockManager
from batchjob.engine.config import EngineConfig
from batchjob.engine.outputs import Request
from batchjob.engine.sampling_params import SamplingParams
from batchjob.engine.scheduler import Scheduler
from batchjob.engine.sequence import Sequence


def check_blocks(bm: BlockManager, seqs: list[Sequence]) -> None:
    held = {}
    for s in seqs:
        assert len(set(s.block_table)) == len(s.block_table)
        for b in s.block_table:
            held[b] = held.get(b, 0) + 1
    for b in range(bm.num_blocks):
        assert bm.ref_count[b] == held.get(b, 0)
    free = {b for b in range(bm.num_blocks) if bm.is_free(b)}
    assert free.isdisjoint(held) and len(free) + len(held) == bm.num_blocks == bm.num_free_blocks + len(held)


@settings(max_examples=300, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    num_blocks=st.integers(8, 64),
    block_size=st.sampled_from([1, 4, 16]),
    max_num_seqs=st.integers(1, 12),
    budget=st.integers(16, 256),
    n_req=st.integers(1, 24),
    policy=st.sampled_from(["newest", "longest_remaining"]),
    watermark=st.sampled_from([0.5, 0.9, 1.0]),
    prefix=st.booleans(),
    elastic=st.booleans(),
)
def test_scheduler_invariants(
    seed, num_blocks, block_size, max_num_seqs, budget, n_req, policy, watermark, prefix, elastic
):
    rng = random.Random(seed)
    cfg = EngineConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        block_size=block_size,
        kv_watermark=watermark,
        preemption_policy=policy,
        enable_prefix_caching=prefix,
        elastic_compression=elastic,
        elastic_max_tokens_floor=2,
        max_bypass=3,
    )
    bm = BlockManager(num_blocks, block_size, prefix)
    sched = Scheduler(cfg, bm)
    capacity = num_blocks * block_size
    shared = [rng.randrange(50) for _ in range(rng.randrange(0, 3 * block_size))]
    seqs = []
    for i in range(n_req):
        # The engine rejects a request that cannot fit the pool alone (prompt + max_tokens); none such here.
        max_tokens = rng.randint(1, min(20, capacity - 1))
        plen = rng.randint(1, min(80, capacity - max_tokens))
        prompt = (shared + [rng.randrange(50) for _ in range(plen)])[: capacity - max_tokens]
        seq = Sequence(Request(str(i), prompt, SamplingParams(max_tokens=max_tokens)), i)
        seqs.append(seq)
        sched.add(seq)
    finished = set()
    for _ in range(20000):
        if not sched.has_work():
            break
        out = sched.schedule()
        assert out.num_batched_tokens <= budget
        assert len(out.scheduled) <= max_num_seqs and len(sched.running) <= max_num_seqs
        assert len({id(s) for s, _ in out.scheduled}) == len(out.scheduled)
        assert all(n >= 1 for _, n in out.scheduled)
        for s, n in out.scheduled:  # the slots for this step's tokens are allocated
            assert len(s.block_table) * block_size >= s.num_computed_tokens + n
        assert bm.num_used_blocks <= num_blocks
        for s in sched.advance(out):
            s.token_ids.append(rng.randrange(50))
            if s.num_output_tokens >= s.max_tokens:
                sched.finish(s, "length")
                finished.add(s.request_id)
        check_blocks(bm, sched.running)
    assert finished == {s.request_id for s in seqs}, "every request finishes (no starvation, no livelock)"
    assert bm.num_free_blocks == num_blocks
    for s in seqs:
        assert s.num_output_tokens == s.max_tokens and s.length_capped == (s.max_tokens < s.params.max_tokens)


def drive(sched: Scheduler, rng: random.Random, steps: int) -> None:
    for _ in range(steps):
        if not sched.has_work():
            return
        out = sched.schedule()
        for s in sched.advance(out):
            s.token_ids.append(rng.randrange(50))
            if s.num_output_tokens >= s.max_tokens:
                sched.finish(s, "length")


def test_preemption_rate_throttles_admission_then_relaxes_and_elastic_caps_waiting_requests():
    rng = random.Random(0)
    cfg = EngineConfig(
        max_num_seqs=16,
        max_num_batched_tokens=64,
        block_size=4,
        kv_watermark=1.0,
        preemption_rate_threshold=1.0,
        elastic_compression=True,
        elastic_max_tokens_floor=3,
    )
    bm = BlockManager(24, 4, enable_prefix_caching=False)
    sched = Scheduler(cfg, bm)
    seqs = [
        Sequence(Request(str(i), [rng.randrange(50) for _ in range(6)], SamplingParams(max_tokens=40)), i)
        for i in range(40)
    ]
    for s in seqs:
        sched.add(s)
    drive(sched, rng, 60)
    assert sched.num_preemptions_total > 0 and sched.throttle > 0
    assert sched.effective_watermark < cfg.kv_watermark
    assert any(s.length_capped and s.max_tokens == 3 for s in seqs)
    drive(sched, rng, 100000)
    assert not sched.has_work()
    for _ in range(200):  # idle steps: no preemptions, so the rate falls and the throttle relaxes
        sched.schedule()
    assert sched.throttle == 0 and sched.preemption_rate == 0
