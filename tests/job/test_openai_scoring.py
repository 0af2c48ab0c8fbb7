"""Scoring through OpenAI Batch lines (the legacy `echo: true, logprobs: k, max_tokens: 0` idiom, vLLM's
`prompt_logprobs`) and prompt logprobs in generate jobs, on the real default model: the responses and the Parquet
columns against Engine.score and one forward pass over the same token ids; the results cache keeps them."""

from __future__ import annotations

import json
import math

import pyarrow.parquet as pq
import pytest

from batchjob.job.cache.results_cache import ResultsCache
from batchjob.job.input.openai_batch import RequestLineError, parse_request
from batchjob.job.run.runner import EXIT_OK, run_job
from batchjob.job.spec import CacheSpec, load_job
from tests.conftest import forward_logits
from tests.helpers import fake_factory, make_job, write_jsonl, write_parquet

ENGINE = {"max_num_seqs": 8, "kv_cache_memory_gb": 0.1, "max_model_len": 512}
TOL = 2e-5  # float32 sums in other orders when prompts are batched or chunked otherwise
PROMPT = "The capital of France is Paris, and the capital of Italy is Rome."
STORY = "Once upon a time, a small fox"


def completion(custom_id: str, prompt: str = PROMPT, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": {"prompt": prompt, **body}}


def chat(custom_id: str, **body) -> dict:
    messages = [{"role": "user", "content": "Name a colour."}]
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"messages": messages, **body},
    }


def run_lines(tmp_path, engine, progress, lines: list[dict], output_format: str = "openai-batch", **sections):
    """An OpenAI Batch job of these lines on the shared real engine: its response lines (or Parquet rows) by id."""
    job = make_job(
        write_jsonl(tmp_path / "batch.jsonl", lines),
        tmp_path / "out",
        model="smollm2-135m-instruct",
        input={"format": "openai-batch"},
        output={"format": output_format},
        engine=ENGINE,
        **sections,
    )
    assert run_job(job, progress, engine_factory=lambda job: engine) == EXIT_OK
    if output_format == "parquet":
        return {r["id"]: r for r in pq.read_table(tmp_path / "out" / "data").to_pylist()}
    return {r["custom_id"]: r for r in map(json.loads, (tmp_path / "out" / "output.jsonl").read_text().splitlines())}


def reference(engine, ids: list[int], k: int) -> tuple[list[float], list[list[int]], list[range]]:
    """Per prompt token after the first: its logprob and k likeliest ids from Engine.score, and the ranks it may have
    in one forward pass of the model over the whole sequence (1 + the tokens likelier than it, give or take the
    tokens within TOL of it, whose order float32 sums in another order may swap)."""
    (score,) = engine.score([ids], prompt_logprobs=k, use_tqdm=False)
    whole = forward_logits(engine.model, ids, last_only=False).log_softmax(-1)
    ranks = []
    for p in range(len(ids) - 1):
        row, chosen = whole[p], whole[p, ids[p + 1]]
        ranks.append(range(int((row > chosen + TOL).sum()) + 1, int((row > chosen - TOL).sum()) + 2))
    return [t.logprob for t in score.token_logprobs], [[i for i, _ in t.top] for t in score.token_logprobs], ranks


def check_prompt_logprobs(engine, field: list, ids: list[int], k: int) -> None:
    """vLLM's prompt_logprobs field: None, then per token {id: {logprob, rank, decoded_token}}, the token first."""
    logprobs, tops, ranks = reference(engine, ids, k)
    assert len(field) == len(ids) and field[0] is None
    for p, entry in enumerate(field[1:]):
        first = next(iter(entry.items()))
        assert first[0] == str(ids[p + 1]) and first[1]["rank"] in ranks[p]
        assert first[1]["decoded_token"] == engine.tokenizer.decode([ids[p + 1]], skip_special_tokens=False)
        assert abs(first[1]["logprob"] - logprobs[p]) <= TOL
        assert [int(key) for _, key in sorted((v["rank"], key) for key, v in entry.items() if v["rank"] <= k)] == tops[
            p
        ]
        assert len(entry) in (k, k + 1)  # the token itself, unless it is among the k likeliest


def test_echo_with_max_tokens_0_scores_the_prompt_as_the_legacy_api(tmp_path, engine, progress):
    out = run_lines(tmp_path, engine, progress, [completion("score", echo=True, logprobs=3, max_tokens=0)])
    body = out["score"]["response"]["body"]
    ids = engine.tokenizer.encode(PROMPT)
    (choice,) = body["choices"]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert body["usage"] == {
        "prompt_tokens": len(ids),
        "completion_tokens": 0,
        "total_tokens": len(ids),
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    lp = choice["logprobs"]
    tokens = [engine.tokenizer.decode([i], skip_special_tokens=False) for i in ids]
    assert lp["tokens"] == tokens and "".join(tokens) == choice["text"]
    assert lp["text_offset"] == [sum(map(len, tokens[:i])) for i in range(len(tokens))]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    logprobs, tops, _ = reference(engine, ids, 3)
    assert max(abs(a - b) for a, b in zip(lp["token_logprobs"][1:], logprobs)) <= TOL
    for top, want in zip(lp["top_logprobs"][1:], tops):
        assert list(top) == [engine.tokenizer.decode([i], skip_special_tokens=False) for i in want]
    # the sum over a continuation, as the legacy idiom reads it off the text offsets
    start = PROMPT.index(" Rome")
    scored = [v for v, at in zip(lp["token_logprobs"], lp["text_offset"]) if at >= start]
    assert scored and math.fsum(scored) < 0
    check_prompt_logprobs(engine, choice["prompt_logprobs"], ids, 3)  # vLLM's field too, as vLLM gives it


def test_a_one_token_prompt_with_max_tokens_0_is_answered(tmp_path, engine, progress):
    """Seen: the line failed ("nothing to score"). As the legacy API and vLLM answer it: the token echoed, with no
    logprob (nothing comes before it), and nothing drawn."""
    assert len(engine.tokenizer.encode("Hello")) == 1
    lines = [
        completion("echo", "Hello", echo=True, logprobs=2, max_tokens=0),
        completion("vllm", "Hello", prompt_logprobs=1, max_tokens=0),
    ]
    out = run_lines(tmp_path, engine, progress, lines)
    echo, vllm = (out[k]["response"]["body"] for k in ("echo", "vllm"))
    assert out["echo"]["error"] is None and out["vllm"]["error"] is None
    (choice,) = echo["choices"]
    assert choice["text"] == "Hello" and choice["finish_reason"] == "length"
    assert choice["logprobs"]["tokens"] == ["Hello"] and choice["logprobs"]["token_logprobs"] == [None]
    assert choice["prompt_logprobs"] == [None] == vllm["choices"][0]["prompt_logprobs"]
    assert echo["usage"]["prompt_tokens"] == 1 and echo["usage"]["completion_tokens"] == 0


def test_an_echo_with_logprobs_from_the_job_file_counts_the_echoed_prompt_in_its_offsets(tmp_path, engine, progress):
    """sampling.logprobs in the job file, echo on the line: the logprobs are the completion's only (the line asked
    for no prompt logprobs), and their text_offset still counts from the start of the choice's text, the prompt."""
    lines = [completion("echo", STORY, echo=True, max_tokens=5), completion("plain", STORY, max_tokens=5)]
    out = run_lines(tmp_path, engine, progress, lines, sampling={"logprobs": True, "top_logprobs": 1})
    echo, plain = (out[k]["response"]["body"]["choices"][0] for k in ("echo", "plain"))
    assert echo["text"] == STORY + plain["text"] and "prompt_logprobs" not in echo
    lp = echo["logprobs"]
    assert lp["tokens"] == plain["logprobs"]["tokens"] and lp["tokens"]
    assert lp["text_offset"] == [len(STORY) + at for at in plain["logprobs"]["text_offset"]]
    assert all(echo["text"][at : at + len(t)] == t for at, t in zip(lp["text_offset"], lp["tokens"]))


def test_echo_with_generation_and_prompt_logprobs_on_both_urls(tmp_path, engine, progress):
    lines = [
        completion("echo", STORY, echo=True, logprobs=2, max_tokens=5),
        completion("plain", STORY, logprobs=2, max_tokens=5),
        completion("echo_text", STORY, echo=True, max_tokens=5),
        completion("vllm", STORY, prompt_logprobs=1, max_tokens=5),
        chat("chat", prompt_logprobs=2, max_tokens=3),
        chat("chat_score", prompt_logprobs=0, max_tokens=0),
    ]
    out = run_lines(tmp_path, engine, progress, lines)
    choice = {k: v["response"]["body"]["choices"][0] for k, v in out.items()}
    ids = engine.tokenizer.encode(STORY)
    generated = choice["plain"]["text"]
    assert generated and choice["echo"]["text"] == STORY + generated == choice["echo_text"]["text"]
    assert choice["echo_text"]["logprobs"] is None and "prompt_logprobs" not in choice["echo_text"]
    # the echoed prompt's logprobs, then the completion's, as a plain completion gives them
    lp, plain = choice["echo"]["logprobs"], choice["plain"]["logprobs"]
    n = len(ids)
    assert lp["tokens"][n:] == plain["tokens"] and lp["token_logprobs"][0] is None
    assert max(abs(a - b) for a, b in zip(lp["token_logprobs"][n:], plain["token_logprobs"])) <= TOL
    assert [list(t) for t in lp["top_logprobs"][n:]] == [list(t) for t in plain["top_logprobs"]]
    assert lp["text_offset"][n:] == [len(STORY) + at for at in plain["text_offset"]]
    assert "".join(lp["tokens"][:n]) == STORY and all(len(t) == 2 for t in lp["top_logprobs"][1:n])
    assert out["echo"]["response"]["body"]["usage"]["completion_tokens"] == len(plain["tokens"])
    # vLLM's prompt_logprobs field: in the choice of a completion, beside its own text
    assert choice["vllm"]["text"] == generated and choice["vllm"]["logprobs"] is None
    check_prompt_logprobs(engine, choice["vllm"]["prompt_logprobs"], ids, 1)
    # and at the top of a chat completion's body
    chat_ids = engine.tokenizer.encode_chat([{"role": "user", "content": "Name a colour."}])
    for key, k in (("chat", 2), ("chat_score", 0)):
        body = out[key]["response"]["body"]
        assert "prompt_logprobs" not in body["choices"][0] and body["usage"]["prompt_tokens"] == len(chat_ids)
        check_prompt_logprobs(engine, body["prompt_logprobs"], chat_ids, k)
    assert choice["chat_score"]["message"]["content"] == "" and choice["chat_score"]["finish_reason"] == "length"


def test_parquet_columns_of_openai_lines_and_of_a_job_file(tmp_path, engine, progress):
    (tmp_path / "a").mkdir()
    row = run_lines(
        tmp_path / "a", engine, progress, [completion("s", echo=True, logprobs=2, max_tokens=0)], "parquet"
    )["s"]
    ids = engine.tokenizer.encode(PROMPT)
    assert row["echo"] == PROMPT and row["output"] == "" and row["output_tokens"] == 0
    check_column(engine, row["prompt_logprobs"], ids, 2)

    # a generate job from a job file: sampling.prompt_logprobs gives every row the column
    texts = [PROMPT, STORY]
    write_parquet(tmp_path / "in.parquet", [{"id": f"r{i}", "text": t} for i, t in enumerate(texts)])
    (tmp_path / "job.yaml").write_text(
        f"model: smollm2-135m-instruct\ninput: {{path: {tmp_path / 'in.parquet'}}}\n"
        f"output: {{path: {tmp_path / 'out'}}}\nprompt: {{chat_template: false}}\n"
        f"sampling: {{max_tokens: 3, prompt_logprobs: 1}}\nengine: {json.dumps(ENGINE)}\n"
    )
    assert run_job(load_job(tmp_path / "job.yaml"), progress, engine_factory=lambda job: engine) == EXIT_OK
    table = pq.read_table(tmp_path / "out" / "data")
    assert table.schema.field("prompt_logprobs").type.value_type.names == [
        "token",
        "logprob",
        "top_logprobs",
        "token_id",
        "rank",
    ]
    for r in table.to_pylist():
        assert r["echo"] is None and r["output_tokens"] == 3
        check_column(engine, r["prompt_logprobs"], engine.tokenizer.encode(texts[int(r["id"][1:])]), 1)


def check_column(engine, column: list[dict], ids: list[int], k: int) -> None:
    """The Parquet prompt_logprobs: one entry per prompt token, the first without a logprob."""
    logprobs, tops, ranks = reference(engine, ids, k)
    decode = lambda i: engine.tokenizer.decode([i], skip_special_tokens=False)  # noqa: E731
    assert [e["token_id"] for e in column] == ids and [e["token"] for e in column] == list(map(decode, ids))
    assert column[0]["logprob"] is None and column[0]["rank"] is None and column[0]["top_logprobs"] is None
    assert max(abs(e["logprob"] - v) for e, v in zip(column[1:], logprobs)) <= TOL
    assert all(e["rank"] in r for e, r in zip(column[1:], ranks))
    assert [[t["token_id"] for t in e["top_logprobs"]] for e in column[1:]] == tops
    assert all(t["token"] == decode(t["token_id"]) for e in column[1:] for t in e["top_logprobs"])


def test_results_cache_keeps_prompt_logprobs_and_never_serves_a_row_without_them(tmp_path, engine, progress):
    lines = [
        completion("s", echo=True, logprobs=2, max_tokens=0),
        completion("g", STORY, prompt_logprobs=1, max_tokens=3),
    ]
    cache = {"path": str(tmp_path / "cache")}
    runs = {}
    for name in ("computed", "hit", "stripped"):
        if name == "stripped":  # every entry rewritten whole (a valid checksum) but without its prompt logprobs
            store = ResultsCache(CacheSpec(**cache))
            for path in (tmp_path / "cache").rglob("*.json"):
                entry = json.loads(path.read_bytes())
                assert entry["result"].pop("prompt_logprobs") is not None
                store.put(entry["key"], entry["result"])
        (tmp_path / name).mkdir()
        runs[name] = run_lines(tmp_path / name, engine, progress, lines, "parquet", cache=cache)
        summary = json.loads((tmp_path / name / "out" / "_summary.json").read_text())
        assert summary["cache"] == ({"hits": 2, "misses": 0} if name == "hit" else {"hits": 0, "misses": 2}), name
    for key in ("s", "g"):
        computed = runs["computed"][key]
        for name in ("hit", "stripped"):
            row = runs[name][key]
            assert row["prompt_logprobs"] == computed["prompt_logprobs"] and row["echo"] == computed["echo"]
            assert row["prompt_logprobs"] is not None and row["output"] == computed["output"]


def test_bad_scoring_lines_fail_alone(tmp_path, progress):
    good = completion("good", max_tokens=4)
    lines = [
        good,
        completion("logprobs_high", echo=True, logprobs=21, max_tokens=0),
        completion("logprobs_neg", logprobs=-1),
        completion("logprobs_text", logprobs="3"),
        completion("plp_high", prompt_logprobs=21),
        completion("plp_bool", prompt_logprobs=True),
        chat("chat_echo", echo=True),
        completion("echo_text", echo="yes"),
        completion("zero_plain", max_tokens=0),
        completion("zero_echo", echo=True, max_tokens=0),
        completion("zero_n", echo=True, logprobs=1, max_tokens=0, n=2),
        completion("zero_false", echo=True, logprobs=1, max_tokens=False),
        completion("logprobs_true", logprobs=True),  # was read as logprobs: 0, an empty top_logprobs each token
        completion("logprobs_false", logprobs=False),
    ]
    # Every number of a line refuses a flag: pydantic would read true as 1 and false as 0.
    numbers = {"n": True, "max_tokens": False, "max_completion_tokens": True, "seed": False, "top_k": True}
    numbers |= {"temperature": True, "top_p": True, "min_p": False, "repetition_penalty": True}
    numbers |= {"presence_penalty": True, "frequency_penalty": False}
    lines += [chat(f"bool_{key}", **{key: value}) for key, value in numbers.items()]
    lines += [chat("bool_top_logprobs", logprobs=True, top_logprobs=True), chat("bool_bias", logit_bias={"5": True})]
    job = make_job(write_jsonl(tmp_path / "batch.jsonl", lines), tmp_path / "out", input={"format": "openai-batch"})
    assert run_job(job, progress, engine_factory=fake_factory()) == EXIT_OK
    rows = {r["id"]: r["error"] for r in pq.read_table(tmp_path / "out" / "data").to_pylist()}
    assert rows.pop("good") is None
    count = "must be an integer from 0 to 20, got"
    want = {
        "logprobs_high": f"body.logprobs {count} 21",
        "logprobs_neg": f"body.logprobs {count} -1",
        "logprobs_text": f"body.logprobs {count} '3'",
        "plp_high": f"body.prompt_logprobs {count} 21",
        "plp_bool": f"body.prompt_logprobs {count} True",
        "chat_echo": "unsupported field echo: only /v1/completions lines echo their prompt",
        "echo_text": "body.echo must be true or false, got 'yes'",
        "zero_plain": "max_tokens: 0 (no token drawn) is for scoring: it needs prompt_logprobs and n 1",
        "zero_echo": "max_tokens: 0 (no token drawn) is for scoring: it needs prompt_logprobs and n 1",
        "zero_n": "max_tokens: 0 (no token drawn) is for scoring: it needs prompt_logprobs and n 1",
        "zero_false": "max_tokens: an integer, not false",  # was read as max_tokens 0
        "logprobs_true": f"body.logprobs {count} True",
        "logprobs_false": f"body.logprobs {count} False",
        "bool_top_logprobs": "top_logprobs: an integer, not true",
        "bool_bias": "logit_bias: a number, not true",
    }
    for key, value in numbers.items():
        counted = key in ("n", "max_tokens", "max_completion_tokens", "seed", "top_k")
        name = "max_tokens" if key == "max_completion_tokens" else key
        want[f"bool_{key}"] = f"{name}: {'an integer' if counted else 'a number'}, not {str(value).lower()}"
    assert set(rows) == set(want)
    for key, message in want.items():
        assert message in rows[key], (key, rows[key])


def test_echo_and_prompt_logprobs_become_sampling_settings():
    values, overrides = parse_request(completion("a", echo=True, logprobs=3, max_tokens=0))
    assert values == {"prompt": PROMPT, "echo": True}
    assert overrides == {"max_tokens": 0, "logprobs": True, "top_logprobs": 3, "prompt_logprobs": 3}
    # the line's own prompt_logprobs wins over logprobs' count for the prompt, as in vLLM
    _, overrides = parse_request(completion("a", echo=True, logprobs=3, prompt_logprobs=5))
    assert overrides["prompt_logprobs"] == 5 and overrides["top_logprobs"] == 3
    values, overrides = parse_request(completion("a", echo=False, prompt_logprobs=0))
    assert values == {"prompt": PROMPT} and overrides == {"prompt_logprobs": 0}
    _, overrides = parse_request(chat("a", echo=False, prompt_logprobs=2))  # a chat line's echo: false is no echo
    assert overrides == {"prompt_logprobs": 2}
    with pytest.raises(RequestLineError, match="unsupported field echo"):
        parse_request(chat("a", echo=True))
