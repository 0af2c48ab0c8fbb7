"""The scoring planner on the fake engine (tokens are UTF-8 bytes): what each row's requests read and score, the room
a continuation or label needs in the context, bad rows, duplicates, and a row's outputs put back together."""

from __future__ import annotations

from batchjob.engine.outputs import RequestOutput, TokenLogprob
from batchjob.job.cache.results_cache import open_cache
from batchjob.job.input.reader import Row
from batchjob.job.input.scoring import ScoreGather, score_planner, score_requests
from batchjob.job.spec import JobSpec
from tests.fakes import FakeEngine

CONTEXT = 40


def plan(rows: list[Row], **sections):
    raw = {"model": "fake", "task": "score", "input": {"path": "x.parquet"}, "output": {"path": "out"}}
    job = JobSpec.model_validate({**raw, **sections})
    errors = {}
    planner = score_planner(job, FakeEngine(max_model_len=CONTEXT), lambda r, e: errors.update({r.id: e}))
    return list(planner.works(rows)), errors


def test_labels_follow_the_prompt_and_wait_for_its_first_prefill():
    rows = [Row(0, "a", {"text": "hi"}), Row(1, "dup", {"text": "hi"}), Row(2, "long", {"text": "x" * 33})]
    works, errors = plan(rows, prompt={"template": "Q {text} A"}, score={"labels": [" yes", " no!"]})
    (work,) = works
    prompt = list(b"Q hi A")
    assert work.token_ids == prompt and work.tails == [list(b" yes"), list(b" no!")] and work.start == len(prompt)
    assert [r.id for r in work.rows] == ["a", "dup"]  # identical rows computed once
    first, second = work.requests()
    assert first.prompt_token_ids == prompt + list(b" yes") and first.after is None
    assert first.prompt_logprobs_start == len(prompt) and first.first_token_alternatives == list(b" ")
    # the second label's first token is scored from the first's row; its request scores the rest
    assert second.prompt_token_ids == prompt + list(b" no!") and second.after == first.request_id
    assert second.prompt_logprobs_start == len(prompt) + 1 and not second.first_token_alternatives
    assert first.params.max_tokens == 0 and first.params.prompt_logprobs == 0
    assert work.scored_tokens == 8 and work.total_tokens == 2 * len(prompt) + 8 and work.num_requests == 2
    # 37 prompt tokens and 4 of the longest label: past the context of 40
    assert errors == {"long": f"prompt is 37 tokens plus 4 to score after it, too long for the model's context of "
                              f"{CONTEXT} (prompt.on_too_long: error)"}  # fmt: skip


def test_a_text_is_scored_from_its_second_token_and_fits_the_context_exactly():
    rows = [Row(0, "a", {"text": "x" * CONTEXT}), Row(1, "b", {"text": "x" * (CONTEXT + 1)})]
    works, errors = plan(rows, score={"prompt_logprobs": 3})
    (work,) = works
    assert work.tails == [[]] and work.start == 1 and work.scored_tokens == CONTEXT - 1
    assert work.requests()[0].params.prompt_logprobs == 3
    assert "prompt is 41 tokens, too long" in errors["b"]


def test_a_continuation_keeps_its_room_when_the_prompt_is_cut():
    rows = [
        Row(0, "ok", {"text": "hello", "ans": " world"}),
        Row(1, "cut", {"text": "y" * 50, "ans": " z"}),
        Row(2, "null", {"text": "q", "ans": None}),
        Row(3, "empty", {"text": "q", "ans": ""}),
        Row(4, "huge", {"text": "q", "ans": "w" * 45}),
        Row(5, "bad", {"text": "q", "ans": "w"}, error="bad JSON"),
    ]
    works, errors = plan(rows, prompt={"on_too_long": "truncate_left"}, score={"continuation_column": "ans"})
    by_id = {w.rows[0].id: w for w in works}
    assert by_id["ok"].token_ids == list(b"hello") and by_id["ok"].tails == [list(b" world")]
    assert by_id["ok"].start == 5 and not by_id["ok"].truncated
    cut = by_id["cut"]
    assert cut.truncated and len(cut.token_ids) + 2 <= CONTEXT and cut.token_ids[-1:] == list(b"y")
    assert errors == {
        "null": "missing continuation: ans is missing or null",
        "empty": "missing continuation: ans is empty (nothing to score)",
        "huge": f"the continuation's 45 tokens leave no room for a prompt in the model's context of {CONTEXT}",
        "bad": "bad JSON",
    }


def test_a_rows_outputs_come_back_together_in_the_labels_order():
    """Labels "a", "bc" and "d" in bytes: "bc"'s request scores its last token, and every label's first comes from
    the first label's row; the outputs come back in any order."""
    works, _ = plan([Row(0, "a", {"text": "hi"})], score={"labels": ["a", "bc", "d"]})
    (work,) = works
    in_flight, gather = {}, ScoreGather()
    requests = list(score_requests(works, in_flight))
    assert set(in_flight) == {r.request_id for r in requests} and len(requests) == 2

    def output(request, logprob):
        start = request.prompt_logprobs_start
        lps = [None] * start + [TokenLogprob(t, logprob) for t in request.prompt_token_ids[start:]]
        out = RequestOutput(request.request_id, request.prompt_token_ids, [], "", "length", prompt_logprobs=lps)
        out.alternative_logprobs = [TokenLogprob(t, logprob - 10) for t in request.first_token_alternatives]
        return out

    done = [
        gather.add(in_flight.pop(r.request_id), output(r, -j - 1.0)) for j, r in reversed(list(enumerate(requests)))
    ]
    assert done[0] is None and in_flight == {}
    score = work.score(done[1])
    # "a": -1; "bc": -11 (from the first request's row) -2; "d": -11
    assert score.label_logprobs == [-1.0, -13.0, -11.0] and score.label == "a"
    assert score.label_probs[0] > score.label_probs[2] > score.label_probs[1]


def test_the_results_cache_keys_a_score_by_everything_that_decides_it(tmp_path):
    row = Row(0, "a", {"text": "hello", "ans": " world"})

    def key(**score):
        job = JobSpec.model_validate(
            {"model": "fake", "task": "score", "input": {"path": "x.parquet"}, "output": {"path": "out"},
             "cache": {"path": str(tmp_path)}, "score": score}
        )  # fmt: skip
        engine = FakeEngine(max_model_len=CONTEXT)
        (work,) = score_planner(job, engine, lambda r, e: None).works([row])
        return open_cache(job, engine).work_key(work)

    keys = [
        key(),
        key(prompt_logprobs=1),
        key(continuation_column="ans"),
        key(labels=[" world", " earth"]),
        key(labels=[" earth", " world"]),
        key(labels=[" world", " earth!"]),
    ]
    assert len(set(keys)) == len(keys)
    # the same computation: the entry holds each token's logprob either way; only the column is left out
    assert key(prompt_logprobs=0) == keys[0]
