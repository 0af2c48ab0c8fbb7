"""Embedding jobs (task: embed) through the CLI on all-MiniLM-L6-v2, with sentence-transformers as the oracle: the
embedding column, truncation, bad rows, kill -9 and resume, OpenAI Batch /v1/embeddings, plan, the job file's checks
and the Python API."""

import base64
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from batchjob.engine.embedder import MAX_PADDING
from batchjob.job.contracts import Embedder
from batchjob.job.output.state import OutputDir
from batchjob.job.spec import JobFileError, load_job
from tests.helpers import REPO, protocol_gaps, write_jsonl, write_parquet
from tests.job.test_e2e import cli, dataset, run_killed

pytestmark = pytest.mark.slow


def write_job(path: Path, model: Path, data: Path, out: Path, **sections) -> Path:
    job = {"model": str(model), "task": "embed", "input": {"path": str(data)}, "output": {"path": str(out)}}
    for key, value in sections.items():
        job[key] = {**job[key], **value} if isinstance(job.get(key), dict) else value
    path.write_text(yaml.safe_dump(job))
    return path


@pytest.fixture(scope="module")
def texts_file(tmp_path_factory, embed_texts) -> Path:
    rows = [{"id": f"t{i}", "text": t, "lang": "en"} for i, t in enumerate(embed_texts)]
    return write_parquet(tmp_path_factory.mktemp("embed") / "texts.parquet", rows)


def embeddings_by_id(out: Path) -> dict[str, dict]:
    return dataset(out)


def cosines(rows: dict, embed_texts, reference) -> list[float]:
    return [
        float(np.dot(rows[f"t{i}"]["embedding"], reference[i]))
        for i, text in enumerate(embed_texts)
        if text  # the empty text is an error row
    ]


@pytest.mark.parametrize("dtype, bound", [("float32", 0.9999), (None, 0.999)])
def test_an_embedding_job_writes_sentence_transformers_embeddings(
    tmp_path, minilm, texts_file, embed_texts, st_embeddings, dtype, bound
):
    # the device and ops keys as a generation job takes them (a GPU's Triton path: tests/kernels/test_bert_triton.py)
    engine = {"dtype": dtype, "device": "cpu", "ops_backend": "torch"} if dtype else {}
    job = write_job(
        tmp_path / "job.yaml", minilm, texts_file, tmp_path / "out", engine=engine, input={"passthrough": ["lang"]}
    )
    result = cli("run", str(job))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"done: {len(embed_texts) - 1} rows ok, 1 failed" in result.stdout
    schema = pq.read_schema(next((tmp_path / "out" / "data").glob("*.parquet")))
    assert schema.field("embedding").type == pa.list_(pa.float32(), 384)
    rows = embeddings_by_id(tmp_path / "out")
    assert min(cosines(rows, embed_texts, st_embeddings.numpy())) >= bound
    numerics = json.loads((tmp_path / "out" / "_job.json").read_text())["fingerprint"]["numerics"]
    assert (numerics["device"], numerics["ops_backend"], numerics["task"]) == ("cpu", "torch", "embed")
    empty = rows[f"t{embed_texts.index('')}"]
    assert empty["embedding"] is None and "missing prompt: text is empty" in empty["error"]
    # What the Embedder ran, in this run's summary: every row's tokens once, padded by at most MAX_PADDING.
    this_run = json.loads((tmp_path / "out" / "_summary.json").read_text())["this_run"]
    tokens = sum(r["prompt_tokens"] for r in rows.values() if r["error"] is None)
    assert this_run["embedded_tokens"] == tokens and this_run["forward_passes"] >= 1, this_run
    assert tokens <= this_run["padded_tokens"] <= MAX_PADDING * tokens, this_run

    from sentence_transformers import SentenceTransformer

    tokenizer = SentenceTransformer(str(minilm), device="cpu").tokenizer
    for i, text in enumerate(embed_texts):
        if text:
            full = len(tokenizer(text)["input_ids"])
            row = rows[f"t{i}"]
            assert (row["prompt_tokens"], row["truncated"]) == (min(full, 256), full > 256), i
            assert row["lang"] == "en" and row["row_index"] == i


def test_a_prompt_template_is_the_text_sentence_transformers_embeds_with_a_prompt(
    tmp_path, minilm, texts_file, embed_texts
):
    from sentence_transformers import SentenceTransformer

    job = write_job(
        tmp_path / "job.yaml",
        minilm,
        texts_file,
        tmp_path / "out",
        prompt={"template": "query: {text}"},
        engine={"dtype": "float32"},
    )
    result = cli("run", str(job))
    assert result.returncode == 0, result.stdout + result.stderr
    texts = [t for t in embed_texts if t]
    reference = SentenceTransformer(str(minilm), device="cpu").encode(texts, prompt="query: ")
    rows = embeddings_by_id(tmp_path / "out")
    ours = [rows[f"t{embed_texts.index(t)}"]["embedding"] for t in texts]
    assert min(float(np.dot(a, b)) for a, b in zip(ours, reference)) >= 0.9999


def test_on_too_long_error_fails_the_long_rows_alone(tmp_path, minilm, texts_file, embed_texts):
    job = write_job(tmp_path / "job.yaml", minilm, texts_file, tmp_path / "out", prompt={"on_too_long": "error"})
    result = cli("run", str(job))
    assert result.returncode == 0, result.stdout + result.stderr
    rows = embeddings_by_id(tmp_path / "out")
    failed = {k for k, r in rows.items() if r["error"]}
    too_long = {k for k, r in rows.items() if r["error"] and "max_seq_length of 256 tokens" in r["error"]}
    assert too_long and failed == too_long | {f"t{embed_texts.index('')}"}
    assert all(r["embedding"] is not None and not r["truncated"] for k, r in rows.items() if k not in failed)


def test_kill_9_mid_run_then_resume_gives_every_row_once(tmp_path, minilm, texts_file, embed_texts, st_embeddings):
    job = write_job(
        tmp_path / "job.yaml",
        minilm,
        texts_file,
        tmp_path / "out",
        output={"checkpoint_rows": 5},
        engine={"max_num_batched_tokens": 512},
    )
    out = OutputDir(tmp_path / "out")
    # Stopped right after its second commit, then killed: mid-run by construction (43 rows, 5 a part).
    done = run_killed(str(job), ("commit", 2, 0.0), tmp_path / "kill.log", out, "embed kill")
    assert 0 < done < len(embed_texts) and not out.succeeded
    assert out.status()["state"] == "stopped (killed; resumable)"
    meta = out.read_job()  # as a batchjob whose embedders ran only on a CPU recorded them: no ops_backend
    del meta["fingerprint"]["numerics"]["ops_backend"]
    (tmp_path / "out" / "_job.json").write_text(json.dumps(meta))
    resumed = cli("run", str(job))
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"resuming: {done} of {len(embed_texts)} rows already done" in resumed.stdout
    rows = embeddings_by_id(tmp_path / "out")  # asserts that no id was written twice
    assert sorted(rows) == sorted(f"t{i}" for i in range(len(embed_texts)))
    assert min(cosines(rows, embed_texts, st_embeddings.numpy())) >= 0.999
    again = cli("run", str(job))
    assert again.returncode == 0 and "already complete" in again.stdout
    generate = cli("run", str(job), "--set", "task=generate", "--set", "model=smollm2-135m-instruct")
    assert generate.returncode == 2 and "task" in generate.stderr and "--restart" in generate.stderr


def test_openai_batch_embeddings_round_trip(tmp_path, minilm, embed_texts, st_embeddings):
    doc = embed_texts[0]  # past 256 tokens: cut
    ref = st_embeddings.numpy()
    ids = [101, 7592, 2088, 102]  # [CLS] hello world [SEP]
    lines = [
        {"custom_id": "one", "url": "/v1/embeddings", "method": "POST", "body": {"input": doc, "model": "m"}},
        {"custom_id": "two", "url": "/v1/embeddings", "body": {"input": [embed_texts[42], doc]}},
        {"custom_id": "b64", "url": "/v1/embeddings", "body": {"input": doc, "encoding_format": "base64"}},
        {"custom_id": "ids", "url": "/v1/embeddings", "body": {"input": ids, "dimensions": 384}},
        {"custom_id": "short", "url": "/v1/embeddings", "body": {"input": doc, "dimensions": 128}},
        {"custom_id": "chat", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "x"}]}},
        {"custom_id": "empty", "url": "/v1/embeddings", "body": {"input": []}},
        {"custom_id": "vocab", "url": "/v1/embeddings", "body": {"input": [[101, 10**6]]}},
        {"custom_id": "extra", "url": "/v1/embeddings", "body": {"input": "x", "truncate": True}},
    ]
    data = write_jsonl(tmp_path / "batch.jsonl", lines)
    job = write_job(
        tmp_path / "job.yaml",
        minilm,
        data,
        tmp_path / "out",
        input={"format": "openai-batch"},
        output={"format": "openai-batch"},
    )
    result = cli("run", str(job))
    assert result.returncode == 0, result.stdout + result.stderr
    out = [json.loads(line) for line in (tmp_path / "out" / "output.jsonl").read_text().splitlines()]
    by_id = {line["custom_id"]: line for line in out}
    assert sorted(by_id) == sorted(line["custom_id"] for line in lines) and len(out) == len(lines)

    def vectors(custom_id):
        body = by_id[custom_id]["response"]["body"]
        assert body["object"] == "list" and body["model"] == str(minilm)
        assert [d["index"] for d in body["data"]] == list(range(len(body["data"])))
        return [np.asarray(d["embedding"], np.float32) for d in body["data"]]

    (one,) = vectors("one")
    assert float(one @ ref[0]) >= 0.999
    short, full = vectors("two")
    assert float(short @ ref[42]) >= 0.999 and float(full @ ref[0]) >= 0.999
    usage = by_id["two"]["response"]["body"]["usage"]
    assert usage["prompt_tokens"] == usage["total_tokens"] > 256
    decoded = np.frombuffer(base64.b64decode(by_id["b64"]["response"]["body"]["data"][0]["embedding"]), "<f4")
    assert np.array_equal(decoded, one)
    (from_ids,) = vectors("ids")
    assert from_ids.shape == (384,) and by_id["ids"]["response"]["body"]["usage"]["prompt_tokens"] == 4
    errors = {k: v["error"]["message"] for k, v in by_id.items() if v["error"]}
    assert set(errors) == {"short", "chat", "empty", "vocab", "extra"}
    assert "not a Matryoshka model" in errors["short"]
    assert "needs task: generate" in errors["chat"]
    assert "body.input must be" in errors["empty"]
    assert "outside the vocabulary" in errors["vocab"]
    assert "unsupported field truncate" in errors["extra"]


def test_dimensions_shorten_a_matryoshka_models_embeddings_and_normalise_them(tmp_path, minilm, embed_texts):
    from batchjob import Engine

    folder = shutil.copytree(minilm, tmp_path / "matryoshka")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [128, 384]}))
    embedder = Engine(str(folder), task="embed", dtype="float32")
    assert embedder.can_shorten_to(128) and embedder.can_shorten_to(384)
    assert not embedder.can_shorten_to(64) and not embedder.can_shorten_to(512)
    (full,) = embedder.embed([embed_texts[3]], use_tqdm=False)
    shortened = np.asarray(embedder.shorten(full.embedding, 128))
    expected = np.asarray(full.embedding[:128]) / np.linalg.norm(full.embedding[:128])
    assert shortened.shape == (128,) and np.allclose(shortened, expected, atol=1e-6)
    # all-MiniLM-L6-v2 itself is not a Matryoshka model
    plain = Engine(str(minilm), task="embed")
    assert plain.can_shorten_to(384) and not plain.can_shorten_to(128)
    assert protocol_gaps(plain, Embedder) == []  # the job layer's contract
    with pytest.raises(ValueError, match="task must be 'generate' or 'embed'"):
        Engine(str(minilm), task="rerank")


def test_plan_counts_an_embedding_jobs_inputs_and_times_them(tmp_path, minilm, texts_file, embed_texts):
    job = write_job(tmp_path / "job.yaml", minilm, texts_file, tmp_path / "out")
    result = cli("plan", str(job), "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    from sentence_transformers import SentenceTransformer

    tokenizer = SentenceTransformer(str(minilm), device="cpu").tokenizer
    lengths = [min(len(tokenizer(t)["input_ids"]), 256) for t in embed_texts if t]
    assert report["rows"] == len(embed_texts) and report["rows_failing_before_the_model"] == 1
    assert report["prompt_tokens_total"] == sum(lengths) and report["requests"] == len(lengths)
    assert report["rows_truncated"] == lengths.count(256) and report["dimension"] == 384
    assert report["calibration"]["tokens_per_s"] > 0 and report["estimated_time_s"] > 0
    text = cli("plan", str(job), "--no-calibrate")
    assert text.returncode == 0 and "rows cut at 256 tokens" in text.stdout


@pytest.mark.parametrize(
    "sections, message",
    [
        ({"sampling": {"max_tokens": 5}}, "sampling: not used with task 'embed'"),
        ({"prompt": {"system": "Be brief."}}, "prompt.system: not used with task 'embed'"),
        ({"prompt": {"chat_template": False}}, "prompt.chat_template: not used with task 'embed'"),
        ({"prompt": {"chat_template_kwargs": {"x": 1}}}, "prompt.chat_template_kwargs: not used with task 'embed'"),
        ({"engine": {"max_num_seqs": 8}}, "engine.max_num_seqs: not used with task 'embed'"),
        ({"engine": {"max_num_batched_tokens": 4}}, "engine.max_num_batched_tokens"),
        ({"input": {"passthrough": ["embedding"]}}, "would clash with result columns"),
        ({"task": "rerank"}, "task: Input should be 'generate', 'embed' or 'score'"),
    ],
)
def test_a_job_file_that_an_embedding_job_cannot_use_fails_in_one_line(tmp_path, minilm, sections, message):
    job = write_job(tmp_path / "job.yaml", minilm, tmp_path / "x.parquet", tmp_path / "out", **sections)
    with pytest.raises(JobFileError) as e:
        load_job(job)
    assert message in str(e.value)
    result = cli("run", str(job))
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr


def test_the_default_too_long_policy_of_an_embedding_job_is_to_cut_the_end(tmp_path, minilm):
    job = load_job(write_job(tmp_path / "job.yaml", minilm, tmp_path / "x.parquet", tmp_path / "out"))
    assert job.prompt.on_too_long == "truncate_right"
    generate = load_job(write_job(tmp_path / "g.yaml", minilm, tmp_path / "x.parquet", tmp_path / "o", task="generate"))
    assert generate.prompt.on_too_long == "error"


def test_a_sigterm_stops_an_embedding_job_after_the_call_under_way(tmp_path, minilm, embed_texts):
    rows = [{"id": f"r{i}", "text": embed_texts[i % 40]} for i in range(400)]
    data = write_parquet(tmp_path / "many.parquet", rows)
    job = write_job(
        tmp_path / "job.yaml",
        minilm,
        data,
        tmp_path / "out",
        output={"checkpoint_rows": 20},
        engine={"max_num_batched_tokens": 256},
    )
    log = tmp_path / "run.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "batchjob.cli", "run", str(job), "--log-interval", "0.2"],
            cwd=REPO,
            stdout=f,
            stderr=subprocess.STDOUT,
        )
    out = OutputDir(tmp_path / "out")
    while not dataset(out.path):  # until the first part is committed
        assert proc.poll() is None, log.read_text()
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGTERM)
    assert proc.wait(60) == 143, log.read_text()
    assert "run again to resume" in log.read_text()
    assert 0 < len(dataset(out.path)) < len(rows)
    resumed = cli("run", str(job))
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert sorted(dataset(out.path)) == sorted(r["id"] for r in rows)


@pytest.mark.parametrize(
    "body, error",
    [
        ({"input": ["x"] * 2049}, "2049 inputs; at most 2048"),
        ({"input": [101, -5, 102]}, "-5 is not a token id"),
        ({"input": [True, False]}, "True is not a token id"),
        ({"input": [101.0, 102]}, "101.0 is not a token id"),
        ({"input": ["ok", ""]}, "body.input[1] must be a non-empty text"),
        ({"input": [[[1]]]}, "body.input[0] must be a non-empty text"),
        ({"input": []}, "body.input must be a text"),
        ({"input": "hi", "dimensions": "abc"}, "dimensions must be a positive integer"),
        ({"input": "hi", "dimensions": 0}, "dimensions must be a positive integer"),
        ({"input": "hi", "encoding_format": "hex"}, "encoding_format must be float or base64"),
        ({"input": "hi", "stream": True}, "unsupported field stream"),
    ],
)
def test_hostile_embedding_lines_fail_alone_with_the_reason(body, error):
    from batchjob.job.input.openai_batch import RequestLineError, parse_request

    with pytest.raises(RequestLineError) as e:
        parse_request({"custom_id": "x", "url": "/v1/embeddings", "body": body}, "embed")
    assert error in str(e.value)


def test_embedding_lines_as_openai_accepts_them():
    from batchjob.job.input.openai_batch import parse_request

    line = {"custom_id": "x", "url": "/v1/embeddings", "body": {"input": "hi", "encoding_format": None, "user": "u"}}
    assert parse_request(line, "embed") == ({"input": ["hi"], "encoding_format": "float", "dimensions": None}, {})
    tokens = {"custom_id": "x", "url": "/v1/embeddings", "body": {"input": [[101, 102], "two"], "model": "m"}}
    assert parse_request(tokens, "embed")[0]["input"] == [[101, 102], "two"]
