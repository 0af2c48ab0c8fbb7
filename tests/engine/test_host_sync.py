"""No host synchronisation inside a step (issue 15): the guard that finds one, and the Triton engine stepping through
chunked prefills, mixed steps, decodes and preemption under it. On a CPU the guard sees the ops whose result the host
reads (host_sync.py); `batchjob selftest --device cuda` runs the same engine under torch's sync debug mode."""

from __future__ import annotations

import random

import pytest
import torch

from batchjob.engine.engine import Engine
from batchjob.engine.host_sync import HostSync, forbid_host_sync
from batchjob.engine.sampling_params import SamplingParams

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    "read",
    [
        lambda x: x.sum().item(),
        lambda x: bool(x.gt(0).all()),
        lambda x: int(x.max()),
        lambda x: float(x.max()),
        lambda x: 1 if x.max() > 0 else 0,
        lambda x: x[x > 0],
        lambda x: x.nonzero(),
        lambda x: torch.repeat_interleave(x.long().abs()),
        lambda x: torch.equal(x, x),
        lambda x: torch.bincount(x.long().abs(), minlength=10),
    ],
)
@pytest.mark.parametrize("inference", [False, True])
def test_the_guard_raises_at_a_read_of_a_device_value(read, inference):
    x = torch.arange(-3.0, 5.0)
    with torch.inference_mode(inference):
        with pytest.raises(HostSync), forbid_host_sync(CPU):
            read(x * 1)
        read(x * 1)  # and is gone after the block


def test_the_guard_lets_a_step_s_device_work_through():
    x, index = torch.arange(12.0).view(4, 3), torch.tensor([2, 0])
    with forbid_host_sync(CPU):
        y = (x[index] @ x.T).softmax(-1)
        torch.repeat_interleave(index, 2, output_size=4)
        x[1:3] = y[:, :3]
        assert y.shape == (2, 4)  # shapes are host values


@pytest.mark.triton
def test_the_triton_engine_steps_without_a_host_synchronisation():
    pytest.importorskip("triton", reason="the Triton kernels need triton (the test extra)")
    # a budget smaller than the long prompts (chunked), a pool smaller than the batch wants (preemption)
    engine = Engine(
        "tiny-llama", load_format="dummy", device="cpu", ops_backend="triton", dtype="float32", block_size=4,
        num_kv_blocks=14, max_num_batched_tokens=16, max_num_seqs=4, max_model_len=128,
    )  # fmt: skip
    engine.runner.forbid_host_sync = True
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (30, 7, 21, 3)]
    steps = []
    engine.add_step_callback(steps.append)
    outs = engine.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [6] * 4
    assert any(s.num_prefill_tokens and s.num_decode_tokens for s in steps)  # mixed steps
    assert sum(s.num_preemptions for s in steps) > 0


@pytest.mark.triton
def test_the_triton_engine_steps_a_moe_model_without_a_host_synchronisation(tmp_path):
    """Qwen3-MoE's sparse layers (and a dense one) on the fused-MoE kernels: prefill chunks, mixed steps, decodes."""
    pytest.importorskip("triton", reason="the Triton kernels need triton (the test extra)")
    pytest.importorskip("transformers", reason="the tiny model is made by transformers (test extra)")
    from tests.oracle.test_tiny_architectures import build, tiny_tokenizer

    build("qwen3moe-top2of8-normtopk-mlponly", tmp_path, tiny_tokenizer().to_str())
    engine = Engine(
        str(tmp_path), device="cpu", ops_backend="triton", dtype="float32", block_size=4, num_kv_blocks=32,
        max_num_batched_tokens=16, max_num_seqs=4, max_model_len=128,
    )  # fmt: skip
    assert engine.runner.model.capturable
    engine.runner.forbid_host_sync = True
    rng = random.Random(6)
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (20, 5, 11)]
    steps = []
    engine.add_step_callback(steps.append)
    outs = engine.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [4] * 3
    assert any(s.num_prefill_tokens and s.num_decode_tokens for s in steps)  # mixed steps
