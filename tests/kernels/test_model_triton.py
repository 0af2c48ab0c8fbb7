"""The whole model through the Triton kernels (in the interpreter on a CPU) against the torch path: a tiny random
Llama, Qwen2 or Phi-3 (GQA, head dim 16) gives the same greedy tokens, with chunked prefill mixing prefill and decode
rows; Qwen3 and Qwen3-MoE against transformers."""

from __future__ import annotations

import random

import pytest
import torch

from batchjob.engine.engine import Engine
from batchjob.engine.sampling_params import SamplingParams
from batchjob.model.llama import LlamaModel
from batchjob.model.loader import load_model
from tests.conftest import forward_logits

pytest.importorskip("transformers", reason="the tiny model is made by transformers (test extra)")
from tests.oracle.test_tiny_architectures import (
    GEMMA_CASES,
    assert_engine_matches_generate,
    build,
    greedy_under_pressure_matches_generate,
    tiny_tokenizer,
)


@pytest.mark.triton
@pytest.mark.parametrize(
    # Phi-4-mini's shape: fused checkpoint, LongRoPE (long factors: the engine's context passes the original 48), rotary
    # on 3/4 of each head
    # the MoE cases: the fused-MoE grouped GEMM against the torch path's per-expert matmuls (sparse and dense
    # layers, top-3 without renormalising; Mixtral's every layer sparse)
    "case",
    [
        "llama-gqa2-untied",
        "qwen2-gqa4-bias-tied",
        "phi4mini-gqa2-tied-longrope-partial-rotary",
        "qwen3moe-top3of6-sparsestep2",
        "mixtral-top2of4",
    ],
)
def test_triton_path_equals_torch_path(case, tmp_path, device):
    build(case, tmp_path, tiny_tokenizer().to_str())
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (3, 21, 40)]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    common = dict(num_kv_blocks=32, block_size=8, max_num_batched_tokens=32, device=device, dtype="float32")
    torch_engine = Engine(str(tmp_path), ops_backend="torch", **common)
    triton_engine = Engine(str(tmp_path), ops_backend="triton", **common)
    torch_out, triton_out = torch_engine.generate(prompts, params), triton_engine.generate(prompts, params)
    assert [o.token_ids for o in triton_out] == [o.token_ids for o in torch_out]
    # a MoE model's steps can be captured on the Triton ops only (the torch path reads its experts' counts)
    moe = torch_engine.runner.model.config.num_experts > 0
    assert triton_engine.runner.model.capturable and torch_engine.runner.model.capturable == (not moe)


@pytest.mark.triton
@pytest.mark.parametrize("case", ["qwen3-gqa2-headdim32-tied", "qwen3moe-top2of8-normtopk-mlponly"])
def test_triton_path_greedy_equals_transformers_under_preemption(case, tmp_path, device):
    """Qwen3's q/k norms (the Triton rms_norm over head rows) and Qwen3-MoE's experts on the Triton ops: the
    oracle test's pool and token budget, tokens equal transformers' generate; every position's logits within 1e-4."""
    from batchjob.kernels import ops as triton_ops

    hf = greedy_under_pressure_matches_generate(case, tmp_path, tiny_tokenizer().to_str(), "triton", device)
    loaded = load_model(str(tmp_path))
    ours = LlamaModel(loaded.config, loaded.weights, triton_ops, device=device)
    ids = random.Random(1).choices(range(3, 300), k=37)
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0]
    diff = (forward_logits(ours, ids, last_only=False).cpu() - ref).abs().max().item()
    assert diff <= 1e-4, f"{case}: logits differ by {diff}"


@pytest.mark.parametrize("case", list(GEMMA_CASES))
def test_triton_gemma_equals_transformers(case, tmp_path, device):
    """Sliding-window layers, soft-capping and Gemma's MLP through the Triton kernels, with chunked prefill and
    preemption: transformers' greedy tokens, and logprobs within 1e-4."""
    hf = build(case, tmp_path, tiny_tokenizer().to_str())
    assert_engine_matches_generate(hf, tmp_path, case, ops_backend="triton", device=device)
