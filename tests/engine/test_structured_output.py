"""Constrained decoding (xgrammar), n samples from one prefill, and top logprobs, on the real default model.
Few prompts, few tokens."""

from __future__ import annotations

import re

import pytest
import torch
from pydantic import ValidationError

from batchjob.engine.sampling_params import SamplingParams
from tests.conftest import chat_messages, forward_logits
from tests.helpers import assert_json_output

PEOPLE = [chat_messages(f"Describe a person named {name} as JSON.") for name in ("Ann", "Bob", "Cyd")]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


def json_schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}


def test_json_schema_outputs_validate_and_compile_once(engine):
    before = engine.structured.num_compiled
    outs = engine.chat(PEOPLE, SamplingParams(max_tokens=40, response_format=json_schema(SCHEMA)), use_tqdm=False)
    assert engine.structured.num_compiled - before <= 1  # one schema, three rows: compiled once (or cached earlier)
    assert any(o.finish_reason == "stop" for o in outs)
    for o in outs:
        assert_json_output(o.text, o.finish_reason, SCHEMA)


def test_json_object_parses(engine):
    # Two questions a short object answers (they stop well within max_tokens) and one the small model rambles on
    # (cut at max_tokens): every row is checked, a finished one parses as an object, a cut one is a prefix of one.
    questions = [
        'Give a JSON object with the key "color" naming one colour.',
        "What is the capital of France? Answer as JSON.",
        'Reply with a JSON object {"answer": ...} giving the sum 2+2.',
    ]
    outs = engine.chat(
        [chat_messages(q) for q in questions],
        SamplingParams(max_tokens=40, response_format={"type": "json_object"}),
        use_tqdm=False,
    )
    assert sum(o.finish_reason == "stop" for o in outs) >= 2, [(o.finish_reason, o.text) for o in outs]
    for o in outs:
        assert_json_output(o.text, o.finish_reason)


def test_choice_and_regex(engine):
    choices = ["yes", "no", "it depends"]
    for o in engine.chat(PEOPLE, SamplingParams(max_tokens=8, choice=choices), use_tqdm=False):
        assert o.finish_reason == "stop" and o.text in choices
    pattern = r"[A-Z][a-z]{1,8} is [0-9]{2}\."
    for o in engine.chat(PEOPLE, SamplingParams(max_tokens=16, regex=pattern), use_tqdm=False):
        assert o.finish_reason == "stop" and re.fullmatch(pattern, o.text), o.text


def test_length_keeps_the_partial_text(engine):
    [o] = engine.chat(PEOPLE[:1], SamplingParams(max_tokens=3, response_format=json_schema(SCHEMA)), use_tqdm=False)
    assert o.finish_reason == "length" and o.text.startswith("{") and len(o.token_ids) == 3


def test_bad_constraints_fail_at_construction():
    with pytest.raises(ValidationError, match="cannot be compiled"):
        SamplingParams(response_format=json_schema({"type": "object", "properties": {"a": {"type": "nonsense"}}}))
    with pytest.raises(ValidationError, match="regex: cannot be compiled"):
        SamplingParams(regex="(unclosed")
    with pytest.raises(ValidationError, match="at most one"):
        SamplingParams(regex="a", choice=["a"])


def test_n_samples_share_one_prefill(engine):
    prompts = [engine.tokenizer.encode_chat(m) for m in PEOPLE]
    steps = []
    engine.add_step_callback(steps.append)
    hits = engine.scheduler.prefix_hits
    engine.block_manager.reset_prefix_cache()
    try:
        outs = engine.generate(prompts, SamplingParams(n=4, temperature=0.8, max_tokens=6, seed=1), use_tqdm=False)
    finally:
        engine.remove_step_callback(steps.append)
    bs = engine.config.block_size
    for o in outs:
        assert len(o.outputs) == 4 and o.text == o.outputs[0].text
        assert len({s.text for s in o.outputs}) > 1  # really sampled
    prefill = sum(s.num_prefill_tokens for s in steps)
    tails = sum(len(p) % bs for p in prompts)
    # Each prompt once; each further sample computes only the prompt's last, partial block (and its first token).
    assert prefill <= sum(len(p) for p in prompts) + 3 * (tails + len(prompts))
    assert engine.scheduler.prefix_hits - hits >= 3 * sum(len(p) // bs * bs for p in prompts)


def test_top_logprobs(engine):
    [o] = engine.chat(PEOPLE[:1], SamplingParams(max_tokens=4, logprobs=True, top_logprobs=3), use_tqdm=False)
    assert len(o.logprobs) == 4
    for lp, token in zip(o.logprobs, o.token_ids):
        assert lp.token_id == token and len(lp.top) == 3
        assert lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1] and lp.logprob <= lp.top[0][1] + 1e-6
    # greedy: the chosen token is the likeliest
    assert all(lp.top[0][0] == lp.token_id for lp in o.logprobs)


def test_constrained_logprobs_are_of_the_unmasked_distribution(engine):
    """The grammar decides which token is drawn, not its logprob: each step's logprob and top list are the model's
    own log-softmax at that position (one forward pass over prompt and output), tokens the grammar forbids
    included, not a distribution renormalised over the allowed tokens."""
    prompt = engine.tokenizer.encode_chat(PEOPLE[0])
    params = SamplingParams(max_tokens=8, regex=r"Zq[0-9]{3}", logprobs=True, top_logprobs=3)
    [o] = engine.generate([prompt], params, use_tqdm=False)
    assert o.finish_reason == "stop" and re.fullmatch(r"Zq[0-9]{3}", o.text), o.text
    ids = prompt + o.token_ids
    raw = torch.log_softmax(forward_logits(engine.model, ids, last_only=False)[len(prompt) - 1 : -1], -1)
    expected = [raw[i, t].item() for i, t in enumerate(o.token_ids)]
    assert min(expected) < -1.0  # the grammar really forced unlikely tokens: masked logprobs would be far apart
    assert len(o.logprobs) == len(o.token_ids)
    for i, (lp, token) in enumerate(zip(o.logprobs, o.token_ids)):
        assert lp.token_id == token and lp.logprob == pytest.approx(expected[i], abs=1e-3), i
        third = raw[i].topk(3).values[-1].item()
        for t, v in lp.top:  # the likeliest tokens of the unmasked row (ties may come in either order)
            assert v == pytest.approx(raw[i, t].item(), abs=1e-3) and v >= third - 1e-3, (i, t)


def test_the_progress_bar_shows_requests_done_and_tokens_per_second(engine, capsys):
    outs = engine.chat(PEOPLE[:2], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=True)
    assert [len(o.token_ids) for o in outs] == [3, 3]
    bar = capsys.readouterr().err.replace("\r", "\n").strip().splitlines()[-1]  # tqdm's last (closing) render
    assert re.search(r"Processed prompts: 100%.* 2/2 \[.*output [\d,]+ tok/s", bar), bar
    engine.chat(PEOPLE[:1], SamplingParams(max_tokens=1), use_tqdm=False)
    assert capsys.readouterr().err == ""


def test_a_request_constraint_replaces_the_jobs_whole():
    job = SamplingParams(max_tokens=9, temperature=0.5, response_format=json_schema(SCHEMA))
    assert job.with_overrides({"temperature": 0.0}).response_format == job.response_format  # kept when not named
    row = job.with_overrides({"regex": "[a-z]+"})
    assert row.regex == "[a-z]+" and row.response_format is None and row.max_tokens == 9
    assert row.grammar_key == ("regex", "[a-z]+")
    assert job.with_overrides({"response_format": {"type": "text"}}).grammar_key is None  # a row may ask for text
    choice = SamplingParams(choice=["a", "b"]).with_overrides({"response_format": json_schema(SCHEMA)})
    assert choice.choice is None and choice.grammar_key == job.grammar_key
    with pytest.raises(ValidationError, match="at most one"):
        job.with_overrides({"regex": "a", "choice": ["a"]})  # within one request, still one constraint
