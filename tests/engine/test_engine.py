"""Continuous batching on the real SmolLM2 model (greedy, float32: the mode whose results do not depend on the
batch): every way of batching a prompt gives the tokens it gets alone — mixed lengths, preemption under a tiny KV
pool, chunked prefill, prefix-cache hits."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from batchjob.engine.engine import Engine
from batchjob.engine.outputs import Request
from batchjob.engine.sampling_params import SamplingParams
from batchjob.model.arithmetic import VERSIONS
from batchjob.model.cpu_features import has_native_bf16
from batchjob.model.cpu_native import native_ops
from batchjob.model.matmul.lm_head import bf16_dot_ops

ROOT = Path(__file__).resolve().parents[2]
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
EXACT = {"dtype": "float32"}


@pytest.fixture(scope="module")
def engine():
    return Engine("smollm2-135m-instruct", **EXACT)


@pytest.fixture(scope="module")
def prompts(engine) -> list[list[int]]:
    """32 chat prompts of mixed lengths (about 30 to 400 tokens) from the sample documents."""
    docs = pq.read_table(ROOT / "sample_data" / "documents.parquet").column("text").to_pylist()
    out = []
    for i in range(32):
        words = docs[i].split()[: 8 + (i * 37) % 260]
        out.append(engine.tokenizer.encode_chat([{"role": "user", "content": "Summarize: " + " ".join(words)}]))
    return out


@pytest.fixture(scope="module")
def alone(engine, prompts) -> list[list[int]]:
    return [engine.generate([p], GREEDY)[0].token_ids for p in prompts]


def test_prompts_are_mixed_lengths(prompts):
    lengths = sorted(len(p) for p in prompts)
    assert len(prompts) >= 32 and lengths[0] < 60 and lengths[-1] > 300


def test_continuous_batching_equals_alone(engine, prompts, alone):
    steps = []
    engine.add_step_callback(steps.append)
    try:
        outs = engine.generate(prompts, GREEDY)
    finally:
        engine.remove_step_callback(steps.append)
    assert [o.token_ids for o in outs] == alone
    assert max(s.num_seqs for s in steps) > 8  # really batched
    assert any(s.num_prefill_tokens and s.num_decode_tokens for s in steps) or len(steps) < len(prompts)


def test_preemption_under_a_small_pool_keeps_outputs(prompts, alone):
    small = Engine("smollm2-135m-instruct", num_kv_blocks=40, kv_watermark=1.0, enable_prefix_caching=False, **EXACT)
    steps = []
    small.add_step_callback(steps.append)
    outs = small.generate(prompts, GREEDY)
    assert sum(s.num_preemptions for s in steps) > 0
    assert max(s.kv_cache_usage for s in steps) <= 1.0
    assert [o.token_ids for o in outs] == alone
    assert small.block_manager.num_free_blocks == small.num_kv_blocks  # nothing leaked


def test_chunked_prefill_under_a_small_token_budget_keeps_outputs(prompts, alone):
    chunked = Engine("smollm2-135m-instruct", max_num_batched_tokens=64, **EXACT)
    steps = []
    chunked.add_step_callback(steps.append)
    outs = chunked.generate(prompts, GREEDY)
    assert all(s.num_prefill_tokens + s.num_decode_tokens <= 64 for s in steps)
    assert [o.token_ids for o in outs] == alone
    # A long prompt was split across steps, and prefill chunks shared steps with decodes.
    assert any(s.num_prefill_tokens and s.num_decode_tokens for s in steps)


def test_shared_prefix_hits_the_cache_and_keeps_outputs(engine):
    doc = pq.read_table(ROOT / "sample_data" / "documents.parquet").column("text").to_pylist()[3]
    system = "You summarize documents for a library catalogue. " + " ".join(doc.split()[:150])
    questions = [
        "Give a title.",
        "List three keywords.",
        "Who is the audience?",
        "One sentence summary.",
        "What is the tone?",
        "Name the main subject.",
    ]
    prompts = [
        engine.tokenizer.encode_chat([{"role": "system", "content": system}, {"role": "user", "content": q}])
        for q in questions
    ]
    alone_out = [engine.generate([p], GREEDY)[0].token_ids for p in prompts]  # warms the cache too
    before = engine.scheduler.prefix_hits
    outs = engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == alone_out
    assert engine.scheduler.prefix_hits - before >= len(prompts) * 150  # the shared system text was reused
    assert all(o.num_cached_tokens >= 150 for o in outs)


def test_identical_requests_share_blocks(engine):
    p = engine.tokenizer.encode_chat([{"role": "user", "content": "Tell me about the sea. " * 20}])
    outs = engine.generate([p] * 4, GREEDY)
    assert len({tuple(o.token_ids) for o in outs}) == 1
    assert sum(o.num_cached_tokens for o in outs) > 0


def test_stream_yields_in_completion_order_and_reports_metrics(engine, prompts):
    reqs = [
        Request(f"r{i}", p, SamplingParams(max_tokens=2 + 6 * (i % 2), ignore_eos=True))
        for i, p in enumerate(prompts[:6])
    ]
    outs = list(engine.stream(iter(reqs)))
    assert sorted(o.request_id for o in outs) == sorted(r.request_id for r in reqs)
    for o in outs:
        m = o.metrics
        assert m.queue_time >= 0 and m.ttft >= m.queue_time and m.total_time >= m.ttft
        assert len(o.token_ids) in (2, 8)


def test_stop_strings_and_tokens(engine):
    p = engine.tokenizer.encode_chat([{"role": "user", "content": "Count from 1 to 20, separated by commas."}])
    [full] = engine.generate([p], SamplingParams(max_tokens=40))
    assert "5" in full.text
    [cut] = engine.generate([p], SamplingParams(max_tokens=40, stop=["5"]))
    assert cut.finish_reason == "stop" and "5" not in cut.text and full.text.startswith(cut.text)
    first = full.token_ids[3]
    [tok] = engine.generate([p], SamplingParams(max_tokens=40, stop_token_ids=[first]))
    assert tok.finish_reason == "stop" and tok.token_ids[-1] == first


def test_a_stop_string_that_ends_inside_a_token(engine):
    """ "Par" ends inside the token " Paris": the output stops at that token, its text cut before the stop string."""
    p = engine.tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    [full] = engine.generate([p], SamplingParams(max_tokens=30), use_tqdm=False)
    assert full.text.startswith("The capital of France is Paris"), full.text
    upto = next(k for k in range(len(full.token_ids)) if "Par" in engine.tokenizer.decode(full.token_ids[: k + 1]))
    assert not engine.tokenizer.decode(full.token_ids[: upto + 1]).endswith("Par")  # the token goes on past it
    [cut] = engine.generate([p], SamplingParams(max_tokens=30, stop=["Par"]), use_tqdm=False)
    assert (cut.finish_reason, cut.text) == ("stop", "The capital of France is ")
    assert cut.token_ids == full.token_ids[: upto + 1]


@pytest.mark.parametrize(
    ("stop", "tokens"),
    [("#-", 1), ("-#", 2), ("-" * 40 + "#", 2)],
    ids=["at-the-start-of-a-long-token", "across-two-long-tokens", "longer-than-the-lookback"],
)
def test_a_stop_string_far_from_the_end_of_a_long_token(engine, stop, tokens):
    """A 65-character token ("#" and 64 dashes), forced by a logit bias, repeated: a stop string is found wherever
    it ends in the step's new text, however far from the text's end, and the text is cut at its first match."""
    long_token = "#" + "-" * 64
    bias = {engine.tokenizer.get_vocab()[long_token]: 100.0}
    p = engine.tokenizer.encode("A ruler:")
    [o] = engine.generate([p], SamplingParams(max_tokens=4, logit_bias=bias, stop=[stop]), use_tqdm=False)
    assert (o.finish_reason, len(o.token_ids)) == ("stop", tokens), o.text
    assert o.text == (long_token * tokens)[: (long_token * tokens).index(stop)]


def test_bad_requests_become_error_outputs(engine):
    too_long = [1] * (engine.max_model_len + 5)
    outs = engine.generate([too_long, [], [10**9], [1, 2, 3]], SamplingParams(max_tokens=2))
    assert [o.finish_reason for o in outs[:3]] == ["error"] * 3
    assert "context" in outs[0].error and outs[1].error == "empty prompt" and "vocabulary" in outs[2].error
    assert outs[3].finish_reason == "length"


def test_seeded_sampling_does_not_depend_on_the_batch(engine, prompts):
    params = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    [single] = engine.generate([prompts[0]], params)
    batch = engine.generate(prompts[:8], [params] + [SamplingParams(max_tokens=8, temperature=1.0)] * 7)
    assert batch[0].token_ids == single.token_ids


def test_abort_all_returns_in_flight(engine, prompts):
    reqs = [
        Request(f"a{i}", p, SamplingParams(max_tokens=2 if i == 0 else 50, ignore_eos=True))
        for i, p in enumerate(prompts[:12])
    ]
    outs = []
    for out in engine.stream(iter(reqs)):
        outs.append(out)
        if len(outs) == 1:
            engine.abort_all()
    assert outs[0].finish_reason == "length"
    assert {o.finish_reason for o in outs[1:]} == {"abort"}
    assert sorted(o.request_id for o in outs) == sorted(r.request_id for r in reqs)
    assert not engine.scheduler.has_work()
    assert engine.block_manager.num_free_blocks == engine.num_kv_blocks


def test_fp8_kv_cache_doubles_blocks_and_stays_close(prompts):
    """e4m3 keeps 3 mantissa bits, so SmolLM2's flat distributions may flip a near-tie; the first token's
    log-probability must stay close and the first token must agree for most prompts."""
    fp8 = Engine("smollm2-135m-instruct", kv_cache_dtype="fp8", kv_cache_memory_gb=0.25, **EXACT)
    ref = Engine("smollm2-135m-instruct", kv_cache_memory_gb=0.25, **EXACT)
    assert fp8.num_kv_blocks >= 1.9 * ref.num_kv_blocks
    params = SamplingParams(max_tokens=1, logprobs=True)
    pairs = list(zip(fp8.generate(prompts[:8], params), ref.generate(prompts[:8], params)))
    agree = [(a.logprobs[0].logprob, b.logprobs[0].logprob) for a, b in pairs if a.token_ids == b.token_ids]
    assert len(agree) >= 6
    assert all(abs(x - y) < 0.25 for x, y in agree)


def test_numerics_are_recorded_as_resolved(engine):
    """The job fingerprint records what ran, not what was written: `dtype: auto` is bfloat16 on a CPU with native
    bf16 (KV cache too), float32 elsewhere."""
    cpp = "+cpp" if native_ops() else ""  # the C++ kernels, where they build (no compiler: torch's)
    exact = {
        "device": "cpu",
        "dtype": "float32",
        "kv_cache_dtype": "float32",
        "ops_backend": "torch" + cpp,
        "matmul": "onednn" if torch.backends.mkldnn.is_available() else "torch",  # packed weights (matmul/linear.py)
    }
    assert engine.numerics == exact
    auto = Engine("smollm2-135m-instruct", load_format="dummy", num_kv_blocks=8)
    resolved = "bfloat16" if has_native_bf16() else "float32"
    bf16 = {"arithmetic": str(VERSIONS["bfloat16"])} if resolved == "bfloat16" else {}  # fp32's is 1, unrecorded
    if bf16 and bf16_dot_ops(torch.device("cpu")):  # the LM head on the bf16 dot product (model/matmul/lm_head.py)
        bf16["matmul"] = "bf16dot+" + exact["matmul"]
    assert auto.numerics == {**exact, "dtype": resolved, "kv_cache_dtype": resolved, **bf16}
    fp8 = Engine("smollm2-135m-instruct", load_format="dummy", kv_cache_dtype="fp8", num_kv_blocks=8, **EXACT)
    assert fp8.numerics["kv_cache_dtype"] == "float8_e4m3fn" and fp8.numerics["dtype"] == "float32"
