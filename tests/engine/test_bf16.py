"""bf16 on a CPU: `dtype: auto` picks it where the CPU computes bf16 natively, and its results stay close to the
exact (float32) mode's on the real model, through the engine's own paths (packed bf16 GEMMs, bf16 KV cache, the C++
bf16 kernels for prefill and decode)."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from batchjob.engine import model_runner
from batchjob.engine.config import EngineConfig
from batchjob.engine.engine import Engine
from batchjob.engine.sampling_params import SamplingParams
from batchjob.model.cpu_features import has_native_bf16
from batchjob.model.matmul.lm_head import bf16_dot_ops
from tests.conftest import teacher_forced_nll
from tests.helpers import summarize_prompts

ROOT = Path(__file__).resolve().parents[2]
CONTINUATION = SamplingParams(max_tokens=24, ignore_eos=True)


def test_native_bf16_is_read_from_the_cpu_flags():
    assert has_native_bf16("flags : fpu sse2 avx512f avx512_bf16 avx512_vnni")
    assert has_native_bf16("flags : fpu amx_tile amx_bf16 avx2")
    assert not has_native_bf16("flags : fpu sse2 avx2 avx512f avx512bw")  # AVX-512 without BF16 emulates it


@pytest.mark.parametrize(("native", "expected"), [(True, torch.bfloat16), (False, torch.float32)])
def test_auto_dtype_on_a_cpu_follows_native_bf16(monkeypatch, native, expected):
    monkeypatch.setattr(model_runner, "has_native_bf16", lambda: native)
    cpu = torch.device("cpu")
    assert model_runner.pick_dtype(EngineConfig(), cpu) == expected
    assert model_runner.pick_dtype(EngineConfig(dtype="float32"), cpu) == torch.float32  # the exact mode, kept


@pytest.fixture(scope="module")
def engines():
    bf16 = Engine("smollm2-135m-instruct", max_num_batched_tokens=512, dtype="bfloat16")  # auto, on this kind
    exact = Engine("smollm2-135m-instruct", max_num_batched_tokens=512, dtype="float32")
    return bf16, exact


@pytest.fixture(scope="module")
def prompts(engines) -> list[list[int]]:
    return summarize_prompts(engines[0].tokenizer)


def test_bf16_runs_with_a_bf16_kv_cache_and_auto_picks_it_where_the_cpu_has_it(engines):
    bf16, exact = engines
    assert model_runner.pick_dtype(EngineConfig(), torch.device("cpu")) == (
        torch.bfloat16 if has_native_bf16() else torch.float32
    )
    assert bf16.numerics["dtype"] == bf16.numerics["kv_cache_dtype"] == "bfloat16"
    assert bf16.numerics["ops_backend"] == exact.numerics["ops_backend"]  # the C++ kernels serve both
    assert bf16.runner.kv_caches[0][0].dtype == torch.bfloat16
    assert bf16.num_kv_blocks >= 1.9 * exact.num_kv_blocks  # the same 2 GiB hold twice the tokens
    gemm = "onednn" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "torch"  # else F.linear, still bf16
    model = bf16.runner.model
    assert all(lin.backend == gemm for lin in model.all_linears()[:-1])
    # the LM head: bf16 W on the bf16 dot product where the CPU has it, else a float32 copy; logits in fp32 either way
    assert model.lm_head.backend == ("bf16dot" if bf16_dot_ops(torch.device("cpu")) else gemm)
    hidden = torch.randn(3, model.config.hidden_size).to(torch.bfloat16)
    assert model.compute_logits(hidden).dtype == torch.float32


def test_bf16_scores_the_exact_continuation_almost_as_well(engines, prompts):
    """Per-token NLL of the float32 engine's greedy continuation, teacher-forced through each model (a prefill over
    prompt + continuation): bf16's within 3 % of float32's. A KV row stored at the wrong slot or a misread head
    makes bf16's many times larger."""
    bf16, exact = engines
    conts = [o.token_ids for o in exact.generate(prompts, CONTINUATION)]

    ours = teacher_forced_nll(bf16.runner.model, prompts, conts)
    ref = teacher_forced_nll(exact.runner.model, prompts, conts)
    assert ref < 1.5  # the exact model's own greedy continuation: confident
    assert abs(ours - ref) <= 0.03 * ref, (ours, ref)


def test_bf16_greedy_decoding_stays_close_to_float32(engines, prompts):
    """Through the engine (batched prefill, decode steps over the bf16 KV cache): the first token equals float32's
    on most prompts, and the greedy continuations share long prefixes (bf16 rounds differently, so a near-tie may
    flip a token somewhere, after which the sequences part)."""
    bf16, exact = engines
    ours = [o.token_ids for o in bf16.generate(prompts, CONTINUATION)]
    ref = [o.token_ids for o in exact.generate(prompts, CONTINUATION)]
    first = sum(a[0] == b[0] for a, b in zip(ours, ref))
    shared = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in zip(ours, ref)]
    assert first >= 10, (first, shared)
    assert sum(shared) >= 0.5 * sum(len(r) for r in ref), shared


def test_bf16_outputs_do_not_depend_on_the_batch_or_the_chunking():
    """As test_engine.py's float32 tests, in bf16: 32 prompts' greedy tokens alone, all in one batch, and in 64-token
    steps (chunked prefill beside decodes) are equal. bf16 rounds every activation, so a last-bit difference that
    float32 absorbs can flip a token here: this holds because a one-row matmul runs as the batch kernels do
    (linear.py) and prefill chunks end on the attention's tile grid (scheduler.py)."""
    docs = pq.read_table(ROOT / "sample_data" / "documents.parquet").column("text").to_pylist()
    engine = Engine("smollm2-135m-instruct", dtype="bfloat16")
    chunked = Engine("smollm2-135m-instruct", max_num_batched_tokens=64, dtype="bfloat16")
    assert engine.numerics["dtype"] == chunked.numerics["dtype"] == "bfloat16"
    words = [" ".join(docs[i].split()[: 8 + (i * 37) % 260]) for i in range(32)]
    prompts = [engine.tokenizer.encode_chat([{"role": "user", "content": "Summarize: " + w}]) for w in words]
    greedy = SamplingParams(max_tokens=12, ignore_eos=True)
    alone = [engine.generate([p], greedy)[0].token_ids for p in prompts]
    assert [o.token_ids for o in engine.generate(prompts, greedy)] == alone
    assert [o.token_ids for o in chunked.generate(prompts, greedy)] == alone


def test_bf16_scoring_through_the_fused_head_equals_the_logits_path(engines, prompts):
    """Engine.score without alternatives runs the bf16 head fused with its log-softmax (no logits written, where
    the CPU has AVX512_BF16); with alternatives asked for, the logits and torch's log_softmax. The two give each
    token's logprob within float32's rounding of the exp sums and the same rank."""
    bf16, _ = engines
    fused, sliced = bf16.score(prompts, use_tqdm=False), bf16.score(prompts, prompt_logprobs=1, use_tqdm=False)
    ranks = []
    for a, b in zip(fused, sliced):
        assert a.num_scored_tokens == b.num_scored_tokens > 0
        for x, y in zip(a.token_logprobs, b.token_logprobs):
            assert x.token_id == y.token_id and abs(x.logprob - y.logprob) <= 1e-4 * max(1.0, abs(y.logprob))
            ranks.append(x.rank == y.rank)
        assert a.token_logprobs[0].top == [] and len(b.token_logprobs[0].top) == 1
    # a rank differs only where subtracting the log-sum-exp rounds a larger logit onto the target's logprob
    assert sum(ranks) >= 0.99 * len(ranks) > 0
