"""Scoring on the real SmolLM2 model (float32): Engine.score and prompt logprobs against the model's own logits of
one whole sequence, however the rows are chunked, packed, preempted or share a prefix; prompt-only rows draw no
token, fill the token budget, and materialise logits only for the positions asked for."""

from __future__ import annotations

import math
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from batchjob.engine.engine import Engine
from batchjob.engine.outputs import Request, RequestOutput, TokenLogprob, score_output
from batchjob.engine.sampling_params import SamplingParams
from batchjob.engine.scheduler import PREFILL_CHUNK_ALIGN
from tests.conftest import forward_logits

ROOT = Path(__file__).resolve().parents[2]
EXACT = {"dtype": "float32"}
TOL = 2e-5  # float32 sums in other orders when a prompt is cut into other chunks
LABELS = [" positive", " negative", " neutral"]


@pytest.fixture(scope="module")
def engine():
    return Engine("smollm2-135m-instruct", max_num_batched_tokens=128, **EXACT)


@pytest.fixture(scope="module")
def texts() -> list[str]:
    """Real documents of about 40 to 600 tokens: some in one chunk of the budget, some in several."""
    docs = pq.read_table(ROOT / "sample_data" / "documents.parquet").column("text").to_pylist()
    return [docs[0][:200], docs[1][:2500], docs[2][:900], "Short one.", docs[3][:1500]]


def whole_logprobs(engine: Engine, ids: list[int]) -> torch.Tensor:
    """The float32 log-softmax of every position of `ids` in one forward pass of the engine's model."""
    return forward_logits(engine.model, ids, last_only=False).log_softmax(-1)


def test_score_equals_one_forward_pass_and_counts_only_asked_rows(engine, texts, monkeypatch):
    rows = []
    real = engine.model.compute_logits
    monkeypatch.setattr(engine.model, "compute_logits", lambda h: rows.append(h.shape[0]) or real(h))
    scores = engine.score(texts, prompt_logprobs=2, use_tqdm=False)
    monkeypatch.undo()
    ids = [engine.tokenizer.encode(t) for t in texts]
    assert max(map(len, ids)) > 3 * engine.token_budget  # chunked over several steps
    # only the positions whose next token is scored: no row for a token to draw, none for a prompt's last position
    assert sum(rows) == sum(len(i) - 1 for i in ids)
    for i, s in zip(ids, scores):
        ref = whole_logprobs(engine, i)
        want = [ref[p, i[p + 1]].item() for p in range(len(i) - 1)]
        assert s.error is None and s.finish_reason == "length" and s.prompt_token_ids == i
        assert s.num_scored_tokens == len(i) - 1 == len(s.token_logprobs)
        assert max(abs(t.logprob - w) for t, w in zip(s.token_logprobs, want)) <= TOL
        assert [t.token_id for t in s.token_logprobs] == i[1:]
        # vLLM's rank: 1 + the tokens likelier than it (give or take those within TOL, which float32 may swap)
        chosen = ref[torch.arange(len(i) - 1), i[1:]][:, None]
        lo, hi = (ref[:-1] > chosen + TOL).sum(-1) + 1, (ref[:-1] > chosen - TOL).sum(-1) + 1
        assert all(a <= t.rank <= b for a, b, t in zip(lo.tolist(), hi.tolist(), s.token_logprobs))
        top = ref[:-1].topk(2, -1)
        assert [[t for t, _ in lp.top] for lp in s.token_logprobs] == top.indices.tolist()
        assert s.sum_nll == pytest.approx(-math.fsum(want), abs=TOL * len(i))
        assert s.mean_nll == pytest.approx(s.sum_nll / s.num_scored_tokens)
        assert s.perplexity == pytest.approx(math.exp(s.mean_nll))


def test_prompt_only_rows_pack_the_token_budget_without_decode(engine, texts):
    steps = []
    engine.add_step_callback(steps.append)
    try:
        engine.score(texts * 4, use_tqdm=False)
    finally:
        engine.remove_step_callback(steps.append)
    budget = engine.token_budget
    assert all(s.num_decode_tokens == 0 for s in steps)
    # every step but the last is full, short only of the chunk grid's remainder (scheduler.PREFILL_CHUNK_ALIGN)
    assert all(budget - PREFILL_CHUNK_ALIGN < s.num_prefill_tokens <= budget for s in steps[:-1])
    total = sum(len(engine.tokenizer.encode(t)) for t in texts) * 4
    assert sum(s.num_prefill_tokens for s in steps) == total  # no prefix-cache read: every scored row is computed


def test_continuation_is_scored_given_the_prompt(engine):
    prompt, cont = "The capital of France is", " Paris, a city on the Seine."
    (s,) = engine.score([prompt], [cont], use_tqdm=False)
    p, c = engine.tokenizer.encode(prompt), engine.tokenizer.encode(cont, add_special_tokens=False)
    ref = whole_logprobs(engine, p + c)
    assert s.prompt_token_ids == p + c and s.num_scored_tokens == len(c)
    assert [t.token_id for t in s.token_logprobs] == c
    want = [ref[len(p) - 1 + j, c[j]].item() for j in range(len(c))]
    assert max(abs(t.logprob - w) for t, w in zip(s.token_logprobs, want)) <= TOL


@pytest.mark.parametrize("labels", [LABELS, [" positive", " not at all positive", " neutral", " mixed feelings"]])
def test_labels_share_the_prompt_prefill_and_equal_their_continuations(engine, texts, labels):
    """A row's labels cost one prefill of its prompt: every label's first token is scored from the prompt's last row
    (one-token labels need nothing more), and a label of more tokens computes only what follows the prompt's full
    blocks, read from the prefix cache. Each label's logprob is still its own continuation's sum."""
    prompts = [f"{t}\nSentiment:" for t in texts[:3]]
    engine.reset_prefix_cache()
    steps = []
    engine.add_step_callback(steps.append)
    try:
        scores = engine.score(prompts, labels=labels, use_tqdm=False)
    finally:
        engine.remove_step_callback(steps.append)
    block = engine.config.block_size
    lengths = [len(engine.tokenizer.encode(p)) for p in prompts]
    tails = [engine.tokenizer.encode(label, add_special_tokens=False) for label in labels]
    longer = [t for t in tails[1:] if len(t) > 1]
    needed = sum(n + len(tails[0]) + sum(n % block + len(t) for t in longer) for n in lengths)
    assert sum(s.num_prefill_tokens for s in steps) == needed
    assert steps[-1].prefix_cache_hits == sum(len(longer) * (n // block * block) for n in lengths)
    for p, s in zip(prompts, scores):
        singles = engine.score([p] * len(labels), labels, use_tqdm=False)
        assert s.label_logprobs == pytest.approx([c.sum_nll * -1 for c in singles], abs=1e-4)
        assert s.label == labels[max(range(len(labels)), key=s.label_logprobs.__getitem__)]
        assert sum(s.label_probs) == pytest.approx(1.0)
        weights = [math.exp(x) for x in s.label_logprobs]
        assert s.label_probs == pytest.approx([w / sum(weights) for w in weights])


def test_scores_survive_preemption_beside_generation_in_a_small_pool(engine, texts):
    """Scoring rows streamed between generation requests whose decodes outgrow a small pool: some scoring rows are
    preempted mid-prompt and computed again, with the logprobs they get alone."""
    small = Engine(
        "smollm2-135m-instruct", num_kv_blocks=32, max_num_batched_tokens=64, kv_watermark=1.0,
        enable_prefix_caching=False, **EXACT,
    )  # fmt: skip
    gen, score = SamplingParams(max_tokens=96, ignore_eos=True), SamplingParams(max_tokens=0, prompt_logprobs=1)
    ids = [small.tokenizer.encode(t) for t in texts * 2]
    requests = []
    for i, row in enumerate(ids):
        requests += [Request(f"g{i}", row[:60], gen), Request(f"s{i}", row, score)]
    outs = {o.request_id: o for o in small.stream(requests)}
    assert any(outs[f"s{i}"].metrics.num_preemptions for i in range(len(ids)))
    for i, w in enumerate(engine.score(ids, prompt_logprobs=1, use_tqdm=False)):
        got = outs[f"s{i}"].prompt_logprobs[1:]
        assert [t.logprob for t in got] == pytest.approx([t.logprob for t in w.token_logprobs], abs=TOL)
        assert [t.top[0][0] for t in got] == [t.top[0][0] for t in w.token_logprobs]


def test_generate_returns_vllm_prompt_logprobs_beside_its_tokens(engine):
    prompt = engine.tokenizer.encode("Once upon a time, in a land far away, there lived")
    (out,) = engine.generate([prompt], SamplingParams(max_tokens=4, prompt_logprobs=0), use_tqdm=False)
    (alone,) = engine.generate([prompt], SamplingParams(max_tokens=4), use_tqdm=False)
    (s,) = engine.score([prompt], use_tqdm=False)
    assert out.token_ids == alone.token_ids and len(out.token_ids) == 4
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    assert [t.logprob for t in out.prompt_logprobs[1:]] == pytest.approx([t.logprob for t in s.token_logprobs])
    assert all(t.top == [] for t in out.prompt_logprobs[1:])


def test_rows_that_cannot_be_scored_come_back_as_errors(engine):
    scores = engine.score(["Fine text here.", "A prompt"], ["and more", ""], use_tqdm=False)
    assert scores[0].error is None and scores[0].num_scored_tokens > 0
    assert scores[1].finish_reason == "error" and "nothing to score" in scores[1].error
    (one,) = engine.score(["Hello"], use_tqdm=False)  # one token, nothing after it
    assert one.finish_reason == "error" and "nothing to score" in one.error
    too_long = engine.score([[1] * (engine.max_model_len + 1)], use_tqdm=False)[0]
    assert too_long.finish_reason == "error" and "context" in too_long.error
    with pytest.raises(ValueError, match="max_tokens: 0"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="not both"):
        engine.score(["a"], ["b"], labels=["c"])


def test_a_row_the_kv_pool_cannot_hold_says_the_kv_cache_blocks_are_too_few():
    """Seen: a scoring row too long for the pool read "prompt of 100 tokens plus max_tokens 0 needs more KV blocks",
    a max_tokens the row never set. It now says what it scores and that the KV cache blocks are too few, how many it
    needs and how many the pool has; the rows that fit are scored beside it."""
    small = Engine("smollm2-135m-instruct", max_model_len=128, num_kv_blocks=4, max_num_seqs=4, **EXACT)
    word = small.tokenizer.encode(" word", add_special_tokens=False)
    prompt, short = word * 100, word * 8
    too_many, fits = small.score([prompt, short], use_tqdm=False)
    pool = "than the pool has (4; raise engine.num_kv_blocks or the KV cache's memory)"
    assert too_many.finish_reason == "error"
    assert too_many.error == f"100 tokens to score need more KV cache blocks (7 of 16 tokens) {pool}"
    assert fits.error is None and fits.num_scored_tokens == 7
    (long_tail,) = small.score([short], [word * 60], use_tqdm=False)
    assert (
        long_tail.error
        == f"prompt of 8 tokens plus 60 to score after it needs more KV cache blocks (5 of 16 tokens) {pool}"
    )
    assert [len(small.tokenizer.encode(x, add_special_tokens=False)) for x in (" yes", " no")] == [1, 1]
    (labelled,) = small.score([word * 64], labels=[" yes", " no"], use_tqdm=False)  # 64 fit the pool, 65 do not
    assert (
        labelled.error
        == f"prompt of 64 tokens plus 1 to score after it needs more KV cache blocks (5 of 16 tokens) {pool}"
    )


def test_a_follower_waits_for_its_leader_and_reads_its_blocks(engine):
    """Request.after: a label variant admitted in the step after its leader's prompt is computed, not beside it."""
    ids = engine.tokenizer.encode("word " * 100)
    params = SamplingParams(max_tokens=0, prompt_logprobs=0)
    tails = [[28], [29]]
    requests = [Request(f"r{j}", ids + t, params, len(ids), after="r0" if j else None) for j, t in enumerate(tails)]
    engine.reset_prefix_cache()
    outs = list(engine.stream(requests))
    assert [o.request_id for o in outs] == ["r0", "r1"]
    block = engine.config.block_size
    assert outs[1].num_cached_tokens == (len(ids) - 1) // block * block and outs[0].num_cached_tokens == 0


def test_label_probabilities_of_very_unlikely_labels_are_their_softmax():
    """Labels whose logprob sums are all far below zero (-900 and -901: exp underflows to 0.0 in a double) still
    get the softmax of their sums, [e / (e + 1), 1 / (e + 1)], not 0/0."""
    start, prompt = 2, [5, 6]
    lps = [None, None, TokenLogprob(7, -450.0), TokenLogprob(8, -450.0)]
    out = RequestOutput("r-0", prompt + [7, 8], [], "", "length", prompt_logprobs=lps)
    out.alternative_logprobs = [TokenLogprob(9, -901.0)]  # the one-token label "no", from the same row
    score = score_output("r", [out], start, ["yes", "no"])
    assert score.label_logprobs == [-900.0, -901.0] and score.label == "yes"
    assert score.label_probs == pytest.approx([math.e / (math.e + 1), 1 / (math.e + 1)], rel=1e-12)
    assert score.label_probs == pytest.approx([0.731, 0.269], abs=5e-4)
