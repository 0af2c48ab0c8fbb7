"""Sizing the KV pool on a GPU (memory_profile.py): the arithmetic, and the steps it measures, which run here on a CPU
on a scratch cache (the allocator figures around them need a GPU: `batchjob selftest --device cuda`)."""

from __future__ import annotations

import pytest
import torch

from batchjob.engine.engine import Engine
from batchjob.engine.errors import DeviceSettingError
from batchjob.engine.memory_profile import MemoryProfile

GIB = 2**30


def test_the_pool_gets_the_fraction_less_the_largest_step_and_the_graphs_pool():
    profile = MemoryProfile(total=100 * GIB, step_peak=3 * GIB, graph_pool=GIB // 2)
    assert profile.kv_budget(0.9) == int(90 * GIB) - 3 * GIB - GIB // 2
    without_graphs = MemoryProfile(total=100 * GIB, step_peak=3 * GIB, graph_pool=0)
    assert without_graphs.kv_budget(0.9) - profile.kv_budget(0.9) == GIB // 2
    # what the allocator holds at its peak once the pool is allocated: the fraction, to the byte
    assert profile.kv_budget(0.5) + profile.step_peak + profile.graph_pool == 50 * GIB


def test_no_room_for_the_pool_is_one_clear_error():
    profile = MemoryProfile(total=80 * GIB, step_peak=6 * GIB, graph_pool=GIB)
    no_room = r"kv_cache_memory_fraction 0.05 of 80.0 GiB leaves no room .* \(6.00 GiB\)"
    with pytest.raises(DeviceSettingError, match=no_room):
        profile.kv_budget(0.05)
    with pytest.raises(DeviceSettingError, match="CUDA graphs' pool"):
        MemoryProfile(total=80 * GIB, step_peak=4 * GIB, graph_pool=GIB).kv_budget(0.0625)


@pytest.mark.parametrize("ops", ["torch", pytest.param("triton", marks=pytest.mark.triton)])
def test_the_measured_steps_run_on_a_scratch_cache(ops):
    """The largest step (a prefill over the whole token budget, logits of max_num_seqs rows), and the padded body of
    the largest decode graph batch, whose rows all write and read the scratch cache's last block and nothing else."""
    if ops == "triton":
        pytest.importorskip("triton", reason="the Triton kernels need triton (the test extra)")
    engine = Engine(
        "tiny-llama", load_format="dummy", device="cpu", ops_backend=ops, dtype="float32", num_kv_blocks=8,
        max_num_batched_tokens=40, block_size=16, max_num_seqs=6, max_model_len=256,
    )  # fmt: skip
    runner = engine.runner
    scratch = runner.make_scratch_caches()
    assert scratch[0][0].shape[0] == 3 + 1  # 40 tokens in blocks of 16, and the padding rows' block
    logits = runner.probe_step(scratch)
    assert logits.shape == (6, engine.model_config.vocab_size) and logits.isfinite().all()
    slots = scratch[0][0].flatten(0, 1).flatten(1)  # [slot, KVH * D] of layer 0's K
    assert slots[:40].ne(0).any(1).all() and slots[40:].eq(0).all()  # the prefill's 40 slots, no more
    for layer in scratch:
        for cache in layer:
            cache.zero_()
    graphs = runner.make_decode_graphs(capture=False, kv_caches=scratch)
    assert graphs.pad.pad_block == 3 and graphs.sizes[-1] == 6
    graphs.run_padding()
    assert graphs.hidden.shape[0] == 6 and graphs.hidden.isfinite().all()
    for layer in scratch:
        written = [i for i in range(4) if layer[0][i].ne(0).any() or layer[1][i].ne(0).any()]
        assert written == [3]
    # the engine's own cache: untouched
    assert torch.equal(runner.kv_caches[0][0], torch.zeros_like(runner.kv_caches[0][0]))


def test_the_largest_step_of_a_budget_over_max_model_len_is_rows_a_step_can_hold():
    """A token budget larger than the context (here 2,500 tokens over a 256-token max_model_len, past the model's
    1,024 positions): the measured step holds sequences of at most max_model_len tokens, as a real step does, not one
    sequence past the model's positions (which failed in rotary)."""
    engine = Engine(
        "tiny-llama", load_format="dummy", device="cpu", dtype="float32", num_kv_blocks=8,
        max_num_batched_tokens=2500, block_size=16, max_num_seqs=6, max_model_len=256,
    )  # fmt: skip
    runner = engine.runner
    scratch = runner.make_scratch_caches()
    logits = runner.probe_step(scratch)
    assert logits.shape == (6, engine.model_config.vocab_size) and logits.isfinite().all()
    written = scratch[0][0].flatten(1).ne(0).any(1)  # [block] of layer 0's K
    assert written.sum() == 9 * 16 + 13 and not written[-1]  # 9 sequences of 16 blocks, and one of 196 tokens
    assert engine.largest_step_host_bytes() > 0
