"""The whole model through the Triton kernels (in the interpreter on a CPU) against the torch path: a tiny random
Llama (GQA, head dim 16) gives the same greedy tokens, with chunked prefill mixing prefill and decode rows."""

from __future__ import annotations

import random

import pytest

from batchjob.engine.engine import Engine
from batchjob.engine.sampling_params import SamplingParams

pytest.importorskip("transformers", reason="the tiny model is made by transformers (test extra)")
from tests.oracle.test_tiny_architectures import GEMMA_CASES, assert_engine_matches_generate, build, tiny_tokenizer


@pytest.mark.triton
@pytest.mark.parametrize("case", ["llama-gqa2-untied", "qwen2-gqa4-bias-tied"])
def test_triton_path_equals_torch_path(case, tmp_path, device):
    build(case, tmp_path, tiny_tokenizer().to_str())
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (3, 21, 40)]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    common = dict(num_kv_blocks=32, block_size=8, max_num_batched_tokens=32, device=device, dtype="float32")
    torch_out = Engine(str(tmp_path), ops_backend="torch", **common).generate(prompts, params)
    triton_out = Engine(str(tmp_path), ops_backend="triton", **common).generate(prompts, params)
    assert [o.token_ids for o in triton_out] == [o.token_ids for o in torch_out]


@pytest.mark.triton
@pytest.mark.parametrize("case", list(GEMMA_CASES))
def test_triton_gemma_equals_transformers(case, tmp_path, device):
    """Sliding-window layers, soft-capping and Gemma's MLP through the Triton kernels, with chunked prefill and
    preemption: transformers' greedy tokens, and logprobs within 1e-4."""
    hf = build(case, tmp_path, tiny_tokenizer().to_str())
    assert_engine_matches_generate(hf, tmp_path, case, ops_backend="triton", device=device)
