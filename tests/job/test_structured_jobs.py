"""Job files and OpenAI Batch lines with response_format, n and logprobs, run in-process on the real model."""

import json
import re

import pyarrow.parquet as pq
import pytest

from batchjob.job.input.openai_batch import RequestLineError, parse_request
from batchjob.job.run.runner import EXIT_OK, run_job
from batchjob.job.spec import JobFileError, load_job
from tests.helpers import assert_json_output, fake_factory, make_job, short_documents, write_jsonl

SCHEMA = {
    "type": "object",
    "properties": {"topic": {"type": "string", "maxLength": 30}, "tone": {"enum": ["formal", "casual", "other"]}},
    "required": ["topic", "tone"],
}
ENGINE = {"max_num_seqs": 8, "kv_cache_memory_gb": 0.1, "max_model_len": 512}


def shared(engine):
    return lambda job: engine


def documents_job(tmp_path, rows: int, template: str, sampling: dict):
    """A job over the first sample documents, cut short, on the real default model."""
    return make_job(
        short_documents(tmp_path, rows=rows, words=30),
        tmp_path / "out",
        model="smollm2-135m-instruct",
        prompt={"template": template},
        sampling=sampling,
        engine=ENGINE,
    )


def test_json_schema_job_over_sample_data_validates(tmp_path, engine, progress):
    job = documents_job(
        tmp_path,
        4,
        "Describe the topic and tone of this text as JSON:\n\n{text}",
        {"max_tokens": 40, "response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}}},
    )
    assert run_job(job, progress, engine_factory=shared(engine)) == EXIT_OK
    rows = pq.read_table(tmp_path / "out" / "data").to_pylist()
    assert len(rows) == 4 and any(r["finish_reason"] == "stop" for r in rows)
    for r in rows:
        assert r["outputs"] == [r["output"]] and r["finish_reasons"] == [r["finish_reason"]]
        assert_json_output(r["output"], r["finish_reason"], SCHEMA)


def test_n_samples_with_logprobs_and_a_choice_in_a_parquet_job(tmp_path, engine, progress):
    choices = ["formal", "casual", "technical"]
    # 12 tokens hold any choice spelled letter by letter, and the stop token: every sample stops.
    sampling = {"max_tokens": 12, "n": 3, "temperature": 0.8, "seed": 7, "choice": choices}
    job = documents_job(
        tmp_path,
        2,
        "Is the tone of this text formal, casual or technical?\n\n{text}",
        sampling | {"logprobs": True, "top_logprobs": 2},
    )
    assert run_job(job, progress, engine_factory=shared(engine)) == EXIT_OK
    rows = pq.read_table(tmp_path / "out" / "data").to_pylist()
    assert len(rows) == 2
    for r in rows:
        assert len(r["outputs"]) == len(r["finish_reasons"]) == len(r["output_token_counts"]) == 3
        assert r["output"] == r["outputs"][0] and r["finish_reason"] == r["finish_reasons"][0]
        assert set(r["outputs"]) <= set(choices) and set(r["finish_reasons"]) == {"stop"}
        assert r["output_tokens"] == sum(r["output_token_counts"])
        assert [len(lp) for lp in r["logprobs"]] == r["output_token_counts"]
        for sample, text in zip(r["logprobs"], r["outputs"]):
            assert "".join(t["token"] for t in sample).startswith(text)  # then the stop token
            assert all(len(t["top_logprobs"]) == 2 and t["logprob"] <= 0 for t in sample)


def test_bad_schema_is_a_job_file_error(tmp_path):
    (tmp_path / "job.yaml").write_text(
        json.dumps(
            {
                "input": {"path": "x.parquet"},
                "output": {"path": "out"},
                "sampling": {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 3}}}},
            }
        )
    )
    with pytest.raises(JobFileError, match="sampling: response_format.json_schema.schema: cannot be compiled"):
        load_job(tmp_path / "job.yaml")


def line(custom_id: str, url: str = "/v1/chat/completions", **body) -> dict:
    key = "messages" if url.endswith("chat/completions") else "prompt"
    prompt = [{"role": "user", "content": "Name a colour."}] if key == "messages" else "Colours: red,"
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": {key: prompt, "max_tokens": 6, **body}}


def test_openai_fields_are_honoured_or_fail_the_row():
    with pytest.raises(RequestLineError, match="unsupported field tools"):
        parse_request(line("a", tools=[]))
    with pytest.raises(RequestLineError, match="stream"):
        parse_request(line("a", stream=True))
    _, overrides = parse_request(line("a", "/v1/completions", logprobs=2, n=3, logit_bias={"15": 5}))
    assert overrides == {"max_tokens": 6, "logprobs": True, "top_logprobs": 2, "n": 3, "logit_bias": {"15": 5}}


@pytest.mark.parametrize("first", ["max_tokens", "max_completion_tokens"])
def test_max_completion_tokens_wins_over_max_tokens_in_either_order(first):
    """OpenAI's API and vLLM take max_completion_tokens; the JSON's key order used to decide."""
    values = {"max_tokens": 50, "max_completion_tokens": 7}
    second = next(k for k in values if k != first)
    body = {"messages": [{"role": "user", "content": "hi"}], first: values[first], second: values[second]}
    _, overrides = parse_request({"custom_id": "a", "url": "/v1/chat/completions", "body": body})
    assert overrides["max_tokens"] == 7


def test_a_schema_keyword_that_would_not_be_enforced_fails_its_row_and_no_other(tmp_path, progress):
    unenforced = {"type": "object", "properties": {"a": {"type": "string", "not": {"const": "x"}}}, "required": ["a"]}
    lines = [line("ok"), line("not", response_format={"type": "json_schema", "json_schema": {"schema": unenforced}})]
    job = make_job(write_jsonl(tmp_path / "batch.jsonl", lines), tmp_path / "out", input={"format": "openai-batch"})
    assert run_job(job, progress, engine_factory=fake_factory()) == EXIT_OK
    rows = {r["id"]: r for r in pq.read_table(tmp_path / "out" / "data").to_pylist()}
    assert rows["ok"]["error"] is None
    assert rows["not"]["error"] == (
        "response_format.json_schema.schema: keyword 'not' at /properties/a is not supported: "
        "the output would not be held to it"
    )


def test_a_schema_keyword_that_would_not_be_enforced_is_a_job_file_error(tmp_path):
    schema = {"type": "string", "format": "idn-email"}
    (tmp_path / "job.yaml").write_text(
        json.dumps(
            {
                "input": {"path": "x.parquet"},
                "output": {"path": "out"},
                "sampling": {"response_format": {"type": "json_schema", "json_schema": {"schema": schema}}},
            }
        )
    )
    with pytest.raises(JobFileError, match="sampling: response_format.json_schema.schema: format 'idn-email' is not"):
        load_job(tmp_path / "job.yaml")


def test_a_huge_n_fails_its_row_and_no_other(tmp_path, progress):
    lines = [line("ok"), line("huge", n=10**12)]
    job = make_job(write_jsonl(tmp_path / "batch.jsonl", lines), tmp_path / "out", input={"format": "openai-batch"})
    assert run_job(job, progress, engine_factory=fake_factory()) == EXIT_OK
    rows = {r["id"]: r for r in pq.read_table(tmp_path / "out" / "data").to_pylist()}
    assert rows["ok"]["error"] is None and "n: Input should be less than or equal to 128" in rows["huge"]["error"]


def run_batch(tmp_path, engine, progress, lines: list[dict], **sections) -> dict[str, dict]:
    """An OpenAI Batch job of these lines on the real default model; its output lines by custom_id."""
    job = make_job(
        write_jsonl(tmp_path / "batch.jsonl", lines),
        tmp_path / "out",
        model="smollm2-135m-instruct",
        input={"format": "openai-batch"},
        output={"format": "openai-batch"},
        engine=ENGINE,
        **sections,
    )
    assert run_job(job, progress, engine_factory=shared(engine)) == EXIT_OK
    return {r["custom_id"]: r for r in map(json.loads, (tmp_path / "out" / "output.jsonl").read_text().splitlines())}


def test_openai_batch_with_n_logprobs_and_response_format(tmp_path, engine, progress):
    lines = [
        line("n2", n=2, temperature=0.8, seed=3, logprobs=True, top_logprobs=2),
        line("json", max_tokens=24, response_format={"type": "json_object"}),
        line("text", "/v1/completions", logprobs=1),
        line("bad", tools=[{"type": "function"}]),
    ]
    out = run_batch(tmp_path, engine, progress, lines)
    assert out["bad"]["error"]["message"].endswith("unsupported field tools")
    body = out["n2"]["response"]["body"]
    assert [c["index"] for c in body["choices"]] == [0, 1]
    counted = 0
    for c in body["choices"]:
        content = c["logprobs"]["content"]
        assert all(len(t["top_logprobs"]) == 2 for t in content)
        # The tokens spell the text (a last token may end inside a character, or be the stop token).
        assert "".join(t["token"] for t in content).startswith(c["message"]["content"])
        counted += len(content)
    assert body["usage"]["completion_tokens"] == counted
    choice = out["json"]["response"]["body"]["choices"][0]
    assert choice["finish_reason"] == "stop", choice  # "Name a colour." as an object is short: it has room to finish
    assert_json_output(choice["message"]["content"], choice["finish_reason"])
    logprobs = out["text"]["response"]["body"]["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(logprobs["text_offset"])


def test_a_rows_constraint_replaces_the_jobs_and_a_bad_one_fails_only_its_row(tmp_path, engine, progress):
    pattern = "[A-Z][a-z]{1,8}"  # the job's constraint, a regex; OpenAI lines can only bring a response_format
    schema = {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}}
    lines = [
        line("job"),  # no constraint of its own: the job's regex
        line("schema", max_tokens=30, response_format=schema),
        line("text", response_format={"type": "text"}),
        line("bad", response_format={"type": "json_schema", "json_schema": {"name": "b", "schema": {"type": 3}}}),
    ]
    out = run_batch(tmp_path, engine, progress, lines, sampling={"regex": pattern})
    assert out["bad"]["response"] is None
    assert "response_format.json_schema.schema: cannot be compiled" in out["bad"]["error"]["message"]
    choice = {k: out[k]["response"]["body"]["choices"][0] for k in ("job", "schema", "text")}
    assert choice["job"]["finish_reason"] == "stop" and re.fullmatch(pattern, choice["job"]["message"]["content"])
    assert_json_output(choice["schema"]["message"]["content"], choice["schema"]["finish_reason"], SCHEMA)
    assert not re.fullmatch(pattern, choice["text"]["message"]["content"])  # free text: neither regex nor JSON
