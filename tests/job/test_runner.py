"""The runner end to end on the fake engine: fast, so every path of a run is covered here."""

import json
import os
import signal
import threading
import time

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import batchjob.job.input.planner
from batchjob.job.exit_codes import EXIT_OK, EXIT_ROW_ERRORS
from batchjob.job.input.reader import InputError
from batchjob.job.output.state import OutputDir, StateError
from batchjob.job.run.executor import LocalExecutor, Pending
from batchjob.job.run.runner import run_job
from batchjob.job.run.stopper import Stopper
from batchjob.job.spec import JobFileError
from tests.helpers import SAMPLE_DATA, Messages, documents, fake_factory, make_job, write_jsonl, write_parquet


def reversed_words(text: str, max_tokens: int = 64) -> str:
    return " ".join(reversed(text.split())).encode()[:max_tokens].decode()


def results(out) -> dict:
    if not list((out / "data").glob("*.parquet")):
        return {}
    table = pq.read_table(out / "data")
    assert len(set(table.column("id").to_pylist())) == table.num_rows, "an id was written twice"
    return {r["id"]: r for r in table.to_pylist()}


@pytest.fixture
def docs(tmp_path):
    return write_parquet(tmp_path / "docs.parquet", documents(23), row_group_size=8)


def test_a_run_writes_every_row_with_its_columns(tmp_path, docs, progress):
    job = make_job(docs, tmp_path / "out", input={"passthrough": ["title", "source"]}, output={"checkpoint_rows": 5})
    started = time.time()
    assert run_job(job, progress, engine_factory=fake_factory()) == EXIT_OK
    wall = time.time() - started
    rows = results(tmp_path / "out")
    assert sorted(rows) == [d["id"] for d in documents(23)]
    doc = documents(23)[6]
    row = rows[doc["id"]]
    assert row["output"] == reversed_words(doc["text"]) and row["finish_reason"] == "stop"
    assert row["title"] == doc["title"] and row["source"] == doc["source"] and row["error"] is None
    assert row["prompt_tokens"] > 0 and row["output_tokens"] == len(row["output"]) and row["row_index"] == 6
    # Each request's own times, from its arrival: in order and within the run. The fake gives a request its first
    # token at its first step and answers one request a step, so first token and finish differ.
    for r in rows.values():
        assert 0 <= r["queue_time_s"] <= r["ttft_s"] < r["total_time_s"] <= wall, r
    summary = json.loads((tmp_path / "out" / "_summary.json").read_text())
    assert (summary["rows_total"], summary["rows_ok"], summary["rows_failed"]) == (23, 23, 0)
    assert (tmp_path / "out" / "_SUCCESS").exists() and len(list((tmp_path / "out" / "data").iterdir())) == 5


def test_sigterm_commits_finished_rows_and_a_rerun_resumes_to_the_same_dataset(tmp_path, docs, progress):
    reference = tmp_path / "reference"
    run_job(make_job(docs, reference), progress, engine_factory=fake_factory())
    job = make_job(docs, tmp_path / "out", output={"checkpoint_rows": 4}, schedule={"sort_window": 6})
    assert run_job(job, progress, engine_factory=fake_factory(signal_at=(5,))) == 143
    assert any(m.startswith("stopping: ") and "to finish" in m for m in progress.messages)
    assert progress.messages[-1].startswith("interrupted:") and "run again to resume" in progress.messages[-1]
    partial = results(tmp_path / "out")
    assert 5 <= len(partial) < 23 and not (tmp_path / "out" / "_SUCCESS").exists()

    engine_runs = []

    def counting_factory(job):
        engine_runs.append(fake_factory()(job))
        return engine_runs[-1]

    assert run_job(job, progress, engine_factory=counting_factory) == EXIT_OK
    assert f"resuming: {len(partial)} of 23 rows already done" in progress.messages
    assert len(engine_runs[0].prompts_seen) == 23 - len(partial)  # finished rows are not computed again
    final = results(tmp_path / "out")
    assert {k: v["output"] for k, v in final.items()} == {k: v["output"] for k, v in results(reference).items()}


def test_a_second_signal_drops_the_requests_in_flight(tmp_path, docs, progress):
    job = make_job(docs, tmp_path / "out", output={"checkpoint_rows": 100})
    assert run_job(job, progress, engine_factory=fake_factory(max_num_seqs=4, signal_at=(3, 4))) == 143
    # 3 finished before the first signal, the fourth brought the second; of the 4 then in flight only the one
    # finished in the step that called abort_all is kept, the others are not written and run on resume.
    committed = results(tmp_path / "out")
    assert len(committed) == 5 and {r["finish_reason"] for r in committed.values()} == {"stop"}
    assert run_job(job, progress, engine_factory=fake_factory()) == EXIT_OK
    assert len(results(tmp_path / "out")) == 23


def test_a_signal_during_the_model_load_stops_before_any_work(tmp_path, docs, progress):
    def interrupted_load(job):
        os.kill(os.getpid(), signal.SIGINT)
        return fake_factory()(job)

    assert run_job(make_job(docs, tmp_path / "out"), progress, engine_factory=interrupted_load) == 130
    assert results(tmp_path / "out") == {} and progress.messages[-1].startswith("interrupted: 0 of 23")


def test_sighup_stops_a_run_like_sigterm_and_it_resumes(tmp_path, docs, progress):
    job = make_job(docs, tmp_path / "out", output={"checkpoint_rows": 4})
    assert run_job(job, progress, engine_factory=fake_factory(signal_at=(5,), signum=signal.SIGHUP)) == 129
    assert 5 <= len(results(tmp_path / "out")) < 23 and progress.messages[-1].startswith("interrupted:")
    assert run_job(job, progress, engine_factory=fake_factory()) == EXIT_OK
    assert len(results(tmp_path / "out")) == 23


def test_a_second_signal_during_the_model_load_stops_it_at_once(tmp_path, docs, progress):
    loaded = []

    def slow_load(job):
        threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGINT)).start()
        time.sleep(0.5)  # the first signal does not end the load
        loaded.append("survived the first signal")
        threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGINT)).start()
        time.sleep(30)  # the second one ends it at once
        loaded.append("finished")
        return fake_factory()(job)

    started = time.monotonic()
    assert run_job(make_job(docs, tmp_path / "out"), progress, engine_factory=slow_load) == 130
    assert time.monotonic() - started < 10 and loaded == ["survived the first signal"]
    assert results(tmp_path / "out") == {} and progress.messages[-1].startswith("interrupted: 0 of 23")
    # No job was recorded, so nothing was written beside data/ (a metrics.prom there would not be batchjob's), and
    # the folder this run made is gone again
    assert not (tmp_path / "out").exists()
    assert run_job(make_job(docs, tmp_path / "out"), progress, engine_factory=fake_factory()) == EXIT_OK
    (tmp_path / "found").mkdir()  # in a folder it found, the same stop leaves its lock and data/ (and no metrics)
    assert run_job(make_job(docs, tmp_path / "found"), progress, engine_factory=slow_load) == 130
    assert sorted(p.name for p in (tmp_path / "found").iterdir()) == ["_lock", "data"]


def test_two_signals_before_the_model_load_mean_it_never_starts(tmp_path, docs, progress):
    """A second signal asks for the stop at once; come before the load (during the input scan, say), it must keep
    the load from starting: once started, a load cannot look at the flag, and would run its minutes to the end."""
    loads = []
    executor = LocalExecutor(loads.append, tmp_path / "_timeline.parquet")
    with Stopper(grace=60) as stopper:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
        assert stopper.count == 2
        # Nothing past the load is reached: the rows, input and folder stay unread.
        executor.execute(Pending(make_job(docs, tmp_path / "out"), *[None] * 5, progress, stopper, lambda _: None))
    assert loads == [] and executor.engine is None and stopper.signum == signal.SIGTERM


def test_at_the_end_of_the_grace_the_requests_in_flight_are_dropped(tmp_path, docs, progress):
    job = make_job(docs, tmp_path / "out", output={"checkpoint_rows": 100})
    assert run_job(job, progress, grace=0, engine_factory=fake_factory(max_num_seqs=4, signal_at=(3,))) == 143
    assert len(results(tmp_path / "out")) == 4  # the step that saw the signal still finished one


def test_a_run_that_finishes_while_stopping_is_complete(tmp_path, docs, progress):
    job = make_job(docs, tmp_path / "out")
    assert run_job(job, progress, engine_factory=fake_factory(max_num_seqs=64, signal_at=(3,))) == EXIT_OK
    assert (tmp_path / "out" / "_SUCCESS").exists() and len(results(tmp_path / "out")) == 23


def test_input_order_output(tmp_path, docs, progress):
    job = make_job(docs, tmp_path / "out", output={"order": "input", "checkpoint_rows": 3, "rows_per_file": 10})
    assert run_job(job, progress, engine_factory=fake_factory()) == EXIT_OK
    files = sorted((tmp_path / "out" / "data").iterdir())
    assert [f.name for f in files] == [f"sorted-{i:06d}.parquet" for i in range(3)]
    assert pq.read_table(tmp_path / "out" / "data").column("id").to_pylist() == [d["id"] for d in documents(23)]


def test_identical_requests_are_computed_once_and_written_for_every_row(tmp_path, progress):
    rows = [{"id": f"r{i}", "text": "same words here" if i % 2 else f"unique {i}"} for i in range(8)]
    engines = []

    def factory(job):
        engines.append(fake_factory()(job))
        return engines[-1]

    job = make_job(write_jsonl(tmp_path / "d.jsonl", rows), tmp_path / "out")
    assert run_job(job, progress, engine_factory=factory) == EXIT_OK
    assert len(engines[0].prompts_seen) == 5
    out = results(tmp_path / "out")
    dupes = [out[f"r{i}"] for i in (1, 3, 5, 7)]
    assert {d["output"] for d in dupes} == {"here words same"}
    assert sorted(d["cached_tokens"] == d["prompt_tokens"] for d in dupes) == [False, True, True, True]


def test_bad_rows_fail_alone_and_the_job_goes_on(tmp_path, progress):
    job = make_job(
        SAMPLE_DATA / "bad_rows.jsonl", tmp_path / "out", input={"passthrough": ["title"]}, fail_on_row_errors=True
    )
    assert run_job(job, progress, engine_factory=fake_factory(max_model_len=16384)) == EXIT_ROW_ERRORS
    rows = results(tmp_path / "out")
    assert len(rows) == 11
    errors = {k: v["error"] for k, v in rows.items()}
    assert [k for k, e in errors.items() if e is None] == ["bad-ok-1", "bad-ok-2", "bad-ok-3"]
    assert errors["bad-missing-text"] == errors["bad-null-text"] == "missing prompt: text is missing or null"
    assert errors["bad-number-text"] == "text must be text, got int"
    assert errors["bad-list-text"] == "text must be text, got list"
    assert errors["bad-empty-text"] == "missing prompt: text is empty"
    assert errors["bad-invalid-utf8"].startswith("line 8 is not valid UTF-8")
    assert errors["bad-too-long"].startswith("prompt is ") and "context of 16384" in errors["bad-too-long"]
    malformed = [k for k in errors if k.endswith("bad_rows.jsonl:6")]
    assert len(malformed) == 1 and errors[malformed[0]].startswith("malformed JSON on line 6")
    assert rows["bad-null-text"]["title"] == "row with null text"
    assert json.loads((tmp_path / "out" / "_summary.json").read_text())["rows_failed"] == 8


def test_too_long_rows_are_truncated_when_asked(tmp_path, progress):
    job = make_job(SAMPLE_DATA / "bad_rows.jsonl", tmp_path / "out", prompt={"on_too_long": "truncate_right"})
    assert run_job(job, progress, engine_factory=fake_factory(max_model_len=16384)) == EXIT_OK
    row = results(tmp_path / "out")["bad-too-long"]
    assert row["error"] is None and row["truncated"] and row["prompt_tokens"] <= 16384 - 64


def test_a_finished_folder_is_left_alone_unless_the_job_changed(tmp_path, docs, progress):
    job = make_job(docs, tmp_path / "out")
    assert run_job(job, progress, engine_factory=fake_factory()) == EXIT_OK
    before = sorted((p.name, p.stat().st_mtime_ns) for p in (tmp_path / "out" / "data").iterdir())

    def no_engine(job):
        raise AssertionError("a finished job must not load the model")

    assert run_job(job, progress, engine_factory=no_engine) == EXIT_OK
    assert "already complete" in progress.messages[-1]
    assert sorted((p.name, p.stat().st_mtime_ns) for p in (tmp_path / "out" / "data").iterdir()) == before

    changed = make_job(docs, tmp_path / "out", sampling={"max_tokens": 5})
    with pytest.raises(StateError, match="sampling changed"):
        run_job(changed, progress, engine_factory=no_engine)
    assert run_job(changed, progress, restart=True, engine_factory=fake_factory()) == EXIT_OK
    assert {len(r["output"].encode()) <= 5 for r in results(tmp_path / "out").values()} == {True}


def test_a_changed_model_refuses_to_resume(tmp_path, docs, progress):
    job = make_job(docs, tmp_path / "out")
    run_job(job, progress, engine_factory=fake_factory(signal_at=(3,)))

    def other_weights(job):
        engine = fake_factory()(job)
        engine.model_digest = "other"
        return engine

    with pytest.raises(StateError, match="model_digest changed"):
        run_job(job, progress, engine_factory=other_weights)


@pytest.mark.parametrize(
    "setting",
    [{"seed": 7}, {"max_model_len": 256}, {"elastic_compression": True}, {"elastic_max_tokens_floor": 8}],
)
def test_a_resume_with_an_engine_setting_that_changes_results_is_refused(tmp_path, docs, progress, setting):
    """A seeded sampled job resumed under another engine.seed would mix two sets of draws in one dataset: the engine
    settings that change what is computed are part of the job, named here one by one (not read from the runner's
    list, which is what is checked)."""
    job = make_job(docs, tmp_path / "out", sampling={"temperature": 0.8}, output={"checkpoint_rows": 4})
    assert run_job(job, progress, engine_factory=fake_factory(signal_at=(5,))) == 143
    partial = results(tmp_path / "out")
    other = make_job(docs, tmp_path / "out", sampling={"temperature": 0.8}, engine=setting)
    with pytest.raises(StateError, match="different job .*: engine changed since"):
        run_job(other, progress, engine_factory=fake_factory())
    assert results(tmp_path / "out") == partial


def on_a_gpu(job):
    engine = fake_factory()(job)
    engine.numerics = {**engine.numerics, "device": "cuda:NVIDIA H200", "dtype": "bfloat16"}
    return engine


def test_a_resume_under_other_numerics_is_refused_unless_allowed_and_then_recorded(tmp_path, docs, progress):
    job = make_job(docs, tmp_path / "out", output={"checkpoint_rows": 4})
    assert run_job(job, progress, engine_factory=fake_factory(signal_at=(9,))) == 143
    partial = results(tmp_path / "out")
    with pytest.raises(StateError, match=r"other numerics \(device cpu -> cuda:NVIDIA H200, dtype float32 -> bf"):
        run_job(job, progress, engine_factory=on_a_gpu)
    assert results(tmp_path / "out") == partial  # refused before anything was added

    assert run_job(job, progress, allow_numerics_change=True, engine_factory=on_a_gpu) == EXIT_OK
    assert sorted(results(tmp_path / "out")) == sorted(d["id"] for d in documents(23))
    meta = json.loads((tmp_path / "out" / "_job.json").read_text())
    assert meta["fingerprint"]["numerics"]["dtype"] == "bfloat16"
    [change] = meta["numerics_changes"]
    assert (change["from"]["dtype"], change["to"]["dtype"]) == ("float32", "bfloat16")


def test_numerics_that_an_older_batchjob_did_not_record_count_as_changed(tmp_path, docs, progress):
    job = make_job(docs, tmp_path / "out")
    run_job(job, progress, engine_factory=fake_factory(signal_at=(3,)))
    meta_file = tmp_path / "out" / "_job.json"
    meta = json.loads(meta_file.read_text())
    del meta["fingerprint"]["numerics"]
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(StateError, match="device unrecorded -> cpu"):
        run_job(job, progress, engine_factory=fake_factory())
    assert run_job(job, progress, allow_numerics_change=True, engine_factory=fake_factory()) == EXIT_OK


def test_a_numerics_key_recorded_only_where_set_counts_when_it_goes(tmp_path, docs, progress):
    """`weights: w8a8` is recorded as numerics["weights"] and dequantize (the default) by its absence: results
    computed with w8a8 refuse a resume without it, and the message names what changed."""

    def w8a8(**config):
        def factory(job):
            engine = fake_factory(**config)(job)
            engine.numerics = {**engine.numerics, "weights": "w8a8"}
            return engine

        return factory

    job = make_job(docs, tmp_path / "out", output={"checkpoint_rows": 4})
    assert run_job(job, progress, engine_factory=w8a8(signal_at=(9,))) == 143
    with pytest.raises(StateError, match=r"other numerics \(weights w8a8 -> unrecorded\)"):
        run_job(job, progress, engine_factory=fake_factory())
    assert run_job(job, progress, engine_factory=w8a8()) == EXIT_OK


def test_numerics_may_change_while_no_result_is_committed(tmp_path, docs, progress):
    job = make_job(docs, tmp_path / "out")
    run_job(job, progress, engine_factory=fake_factory(signal_at=(3,)))
    for part in (tmp_path / "out" / "data").glob("*.parquet"):  # _job.json written, no result committed yet
        part.unlink()
    assert run_job(job, progress, engine_factory=on_a_gpu) == EXIT_OK
    assert "numerics_changes" not in json.loads((tmp_path / "out" / "_job.json").read_text())


def test_duplicate_ids_stop_the_job_before_the_model_loads(tmp_path, progress):
    job = make_job(write_jsonl(tmp_path / "d.jsonl", documents(3) + documents(1)), tmp_path / "out")
    with pytest.raises(InputError, match="1 duplicate ids"):
        run_job(job, progress, engine_factory=lambda job: pytest.fail("loaded the model"))


def test_openai_batch_round_trip(tmp_path, progress):
    lines = [
        {
            "custom_id": "chat-1",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "x", "messages": [{"role": "user", "content": "one two three"}], "max_tokens": 7},
        },
        {"custom_id": "cmpl-1", "method": "POST", "url": "/v1/completions", "body": {"prompt": "four five"}},
        {"custom_id": "bad-1", "method": "POST", "url": "/v1/completions", "body": {"prompt": None}},
    ]
    job = make_job(
        write_jsonl(tmp_path / "b.jsonl", lines),
        tmp_path / "out",
        input={"format": "openai-batch"},
        output={"format": "openai-batch"},
    )
    assert run_job(job, progress, engine_factory=fake_factory()) == EXIT_OK
    out = {o["custom_id"]: o for o in map(json.loads, (tmp_path / "out" / "output.jsonl").read_text().splitlines())}
    chat = out["chat-1"]["response"]
    assert chat["status_code"] == 200 and chat["body"]["object"] == "chat.completion"
    assert chat["body"]["choices"][0]["message"] == {"role": "assistant", "content": "three t"}
    assert chat["body"]["choices"][0]["finish_reason"] == "length" and chat["body"]["usage"]["completion_tokens"] == 7
    assert out["cmpl-1"]["response"]["body"]["choices"][0]["text"] == "five four"
    assert out["bad-1"]["response"] is None and out["bad-1"]["error"]["message"].startswith("missing prompt")


def no_chat_template(job):
    """The fake engine as a base model: no chat template."""
    engine = fake_factory()(job)
    engine.tokenizer.chat_template = None

    def refuse(messages, add_generation_prompt=True):
        raise ValueError("this model has no chat template")

    engine.tokenizer.apply_chat_template = refuse
    return engine


def test_a_base_model_takes_text_prompts_as_they_are_and_chat_messages_fail_before_any_work(tmp_path, docs, progress):
    """A model without a chat template (a base model) gets the filled template as plain text, with one message
    that says so; a job of chat messages cannot run on it and fails before any work."""
    prompt = {"system": "Be brief.", "template": "Sum up: {text}"}
    job = make_job(docs, tmp_path / "out", prompt=prompt)
    engine = no_chat_template(job)
    assert run_job(job, progress, engine_factory=lambda job: engine) == EXIT_OK
    assert any("no chat template (a base model)" in m for m in progress.messages)
    prompts = [bytes(ids).decode() for ids in engine.prompts_seen]
    assert prompts and all(p.startswith("Be brief.\n\nSum up: ") for p in prompts)
    plain = make_job(
        docs, tmp_path / "out3", prompt={"system": "Be brief.", "template": "Sum up: {text}", "chat_template": False}
    )
    other = no_chat_template(plain)
    assert run_job(plain, Messages(), engine_factory=lambda job: other) == EXIT_OK
    assert other.prompts_seen == engine.prompts_seen  # the same prompts as the explicit setting
    messages = write_jsonl(tmp_path / "chats.jsonl", [{"id": "a", "messages": [{"role": "user", "content": "hi"}]}])
    job = make_job(messages, tmp_path / "out2", input={"messages_column": "messages"})
    with pytest.raises(JobFileError, match="input.messages_column: chat messages need a chat template"):
        run_job(job, progress, engine_factory=no_chat_template)
    assert not (tmp_path / "out2").exists()  # the folder it made is gone again (nothing was written)


def test_an_openai_batch_of_completions_runs_on_a_model_without_a_chat_template(tmp_path, progress):
    """Only chat lines need a template: a file of /v1/completions lines ran nowhere but on chat models, and a chat
    line among them fails alone."""
    completion = {"custom_id": "c", "url": "/v1/completions", "body": {"prompt": "one two", "max_tokens": 9}}
    chat = {"custom_id": "m", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "x"}]}}
    batch = write_jsonl(tmp_path / "batch.jsonl", [completion, chat])
    job = make_job(batch, tmp_path / "out", input={"format": "openai-batch"})
    assert run_job(job, progress, engine_factory=no_chat_template) == EXIT_OK
    rows = results(tmp_path / "out")
    assert rows["c"]["error"] is None and rows["c"]["output"] == "two one"
    assert rows["m"]["error"] == (
        "a /v1/chat/completions line needs a chat template, and this model has none "
        "(a /v1/completions line with body.prompt needs none)"
    )


def test_bad_rows_keep_their_ids_when_the_input_path_is_spelled_otherwise(tmp_path, progress, monkeypatch):
    """Seen: a resume with `./x/../bad_rows.jsonl` committed the bad rows again, then '-2 of 12 rows got no result'."""
    data = tmp_path / "in"
    data.mkdir()
    (data / "bad_rows.jsonl").write_bytes((SAMPLE_DATA / "bad_rows.jsonl").read_bytes())
    monkeypatch.chdir(tmp_path)
    first = make_job("in/bad_rows.jsonl", tmp_path / "out", output={"checkpoint_rows": 1})
    assert run_job(first, progress, engine_factory=fake_factory(max_model_len=16384)) == EXIT_OK
    # As a kill before the last part and _SUCCESS leaves it: the bad rows committed, one good row not.
    for name in ("_SUCCESS", "_summary.json", "data/part-000010.parquet"):
        (tmp_path / "out" / name).unlink()
    again = make_job("./in/../in/bad_rows.jsonl", tmp_path / "out")
    assert run_job(again, progress, engine_factory=fake_factory(max_model_len=16384)) == EXIT_OK
    assert len(results(tmp_path / "out")) == 11


def test_rows_per_file_is_part_of_the_job(tmp_path, docs, progress):
    job = make_job(docs, tmp_path / "out", output={"order": "input", "rows_per_file": 5})
    assert run_job(job, progress, engine_factory=fake_factory()) == EXIT_OK
    other = make_job(docs, tmp_path / "out", output={"order": "input", "rows_per_file": 8})
    with pytest.raises(StateError, match="output changed"):
        run_job(other, progress, engine_factory=fake_factory())
    assert run_job(other, progress, restart=True, engine_factory=fake_factory()) == EXIT_OK
    assert len(results(tmp_path / "out")) == 23 and len(list((tmp_path / "out" / "data").iterdir())) == 3


def test_an_output_folder_that_holds_the_input_is_refused_before_any_work(tmp_path, progress):
    (tmp_path / "in").mkdir()
    data = write_jsonl(tmp_path / "in" / "d.jsonl", documents(3))
    for out in [tmp_path / "in", tmp_path]:
        with pytest.raises(InputError, match=f"{data} is inside the output folder {out}; give output.path a folder"):
            run_job(make_job(data, out), progress, engine_factory=fake_factory())
        with pytest.raises(InputError, match=f"no file matches .* outside the output folder {out}, which is never"):
            run_job(make_job(tmp_path / "in" / "*.jsonl", out), progress, engine_factory=fake_factory())
    assert data.read_bytes() == write_jsonl(tmp_path / "copy.jsonl", documents(3)).read_bytes()
    assert sorted(p.name for p in (tmp_path / "in").iterdir()) == ["d.jsonl"]  # nothing written, not even a lock
    assert sorted(p.name for p in tmp_path.iterdir()) == ["copy.jsonl", "in"]


@pytest.mark.parametrize("stop_first", [True, False])
def test_a_glob_that_covers_the_output_folder_reruns_after_a_stop_and_when_finished(tmp_path, progress, stop_first):
    d = tmp_path / "D"
    (d / "a").mkdir(parents=True)
    write_parquet(d / "a" / "docs.parquet", documents(23), row_group_size=8)
    out = d / "summaries"
    job = make_job(f"{d}/**/*.parquet", out, output={"checkpoint_rows": 4})
    if stop_first:
        assert run_job(job, progress, engine_factory=fake_factory(signal_at=(5,))) == 143
        assert 5 <= len(results(out)) < 23
    else:
        assert run_job(job, progress, engine_factory=fake_factory()) == EXIT_OK
    assert (out / "_timeline.parquet").exists()  # what the glob matches now
    for _ in range(2):  # a resume that finishes, then a rerun of the finished job
        assert run_job(job, progress, engine_factory=fake_factory()) == EXIT_OK
        assert sorted(results(out)) == [doc["id"] for doc in documents(23)]
    assert progress.messages[-1] == f"{out} is already complete (_SUCCESS, same job): nothing to do"


def test_an_output_path_that_is_a_file_is_refused_and_left_alone(tmp_path, docs, progress):
    (tmp_path / "out").write_text("a user's file")
    with pytest.raises(StateError, match="is a file; give it a folder"):
        run_job(make_job(docs, tmp_path / "out"), progress, engine_factory=fake_factory())
    assert (tmp_path / "out").read_text() == "a user's file"


def test_a_refused_restart_does_not_say_it_discarded_anything(tmp_path, docs, progress):
    (tmp_path / "out" / "data").mkdir(parents=True)
    (tmp_path / "out" / "data" / "mine.csv").write_text("a user's file")
    with pytest.raises(StateError, match="did not write"):
        run_job(make_job(docs, tmp_path / "out"), progress, restart=True, engine_factory=fake_factory())
    assert not any("discard" in m for m in progress.messages)
    assert (tmp_path / "out" / "data" / "mine.csv").read_text() == "a user's file"


def test_an_empty_input_is_recorded_so_a_filled_one_is_not_taken_as_done(tmp_path, progress):
    """Seen: a job run on an empty file left _SUCCESS and no _job.json; after the file was filled, a rerun said
    "already complete" and exited 0 without computing a row."""
    data = write_jsonl(tmp_path / "d.jsonl", [])
    job = make_job(data, tmp_path / "out")
    assert run_job(job, progress, engine_factory=lambda job: pytest.fail("loaded the model")) == EXIT_OK
    assert json.loads((tmp_path / "out" / "_job.json").read_text())["rows_total"] == 0
    assert run_job(job, progress, engine_factory=fake_factory()) == EXIT_OK
    assert "already complete" in progress.messages[-1]
    write_jsonl(data, documents(4))
    with pytest.raises(StateError, match="input changed"):
        run_job(job, progress, engine_factory=fake_factory())
    assert run_job(job, progress, restart=True, engine_factory=fake_factory()) == EXIT_OK
    assert len(results(tmp_path / "out")) == 4


def test_a_success_marker_that_no_job_record_explains_is_not_taken_as_done(tmp_path, docs, progress):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "_SUCCESS").write_text("")
    assert run_job(make_job(docs, tmp_path / "out"), progress, engine_factory=fake_factory()) == EXIT_OK
    assert len(results(tmp_path / "out")) == 23


def test_a_binary_text_column_is_read_as_utf8_and_bad_bytes_fail_their_row(tmp_path, progress):
    texts = [b"a fine text", "\u00e9t\u00e9 ok".encode(), b"\xff\xfe not utf-8"]
    pq.write_table(pa.table({"id": ["a", "b", "c"], "text": pa.array(texts, pa.binary())}), tmp_path / "b.parquet")
    assert run_job(make_job(tmp_path / "b.parquet", tmp_path / "out"), progress, engine_factory=fake_factory()) == 0
    rows = results(tmp_path / "out")
    assert rows["a"]["output"] == "text fine a" and rows["b"]["output"] == "ok \u00e9t\u00e9"
    assert "text is bytes that are not UTF-8" in rows["c"]["error"]


@pytest.mark.parametrize("order", ["completion", "input"])
def test_a_part_dropped_after_the_job_finished_is_redone_and_the_completion_files_go_first(tmp_path, order, progress):
    """Seen: with a part gone, _SUCCESS stood and every rerun said "already complete" over the missing rows."""
    lines = [{"custom_id": f"c{i}", "url": "/v1/completions", "body": {"prompt": f"w{i} x"}} for i in range(9)]
    out = tmp_path / "out"
    job = make_job(
        write_jsonl(tmp_path / "b.jsonl", lines),
        out,
        input={"format": "openai-batch"},
        output={"format": "openai-batch", "checkpoint_rows": 3, "order": order, "rows_per_file": 3},
    )
    assert run_job(job, progress, engine_factory=fake_factory()) == EXIT_OK
    sorted(out.glob("data/*.parquet"))[1].unlink()
    assert OutputDir(out).status()["state"].startswith("incomplete (3 rows missing")

    def no_model(job):  # the completion files are gone before any model loads
        assert not any((out / name).exists() for name in ("_SUCCESS", "_summary.json", "output.jsonl"))
        return fake_factory()(job)

    assert run_job(job, progress, engine_factory=no_model) == EXIT_OK
    assert "rows are missing since; they will be redone" in " ".join(progress.messages)
    assert len(results(out)) == 9 and OutputDir(out).status()["state"] == "done"
    assert len((out / "output.jsonl").read_text().splitlines()) == 9


def echo_job(tmp_path, order: str = "completion"):
    """An OpenAI Batch job of 9 echo lines, 3 rows a part (or a sorted file)."""
    lines = [
        {"custom_id": f"c{i}", "url": "/v1/completions", "body": {"prompt": f"w{i} x", "echo": True}} for i in range(9)
    ]
    return make_job(
        write_jsonl(tmp_path / "b.jsonl", lines),
        tmp_path / "out",
        input={"format": "openai-batch"},
        output={"checkpoint_rows": 3, "order": order, "rows_per_file": 3},
    )


@pytest.mark.parametrize("order", ["completion", "input"])
def test_a_folder_resumed_across_new_columns_reads_as_one_dataset(tmp_path, order, progress):
    """Seen: an OpenAI Batch folder begun before the prompt columns (echo, prompt_logprobs) existed and finished
    after: pq.read_table took the first file's schema and dropped the columns that the later rows have."""
    job, out = echo_job(tmp_path, order), tmp_path / "out"
    assert run_job(job, progress, engine_factory=fake_factory()) == EXIT_OK
    first, *others = sorted(out.glob("data/*.parquet"))
    older = pq.read_table(first).drop_columns(["prompt_logprobs", "echo"])  # as a batchjob before them wrote it
    pq.write_table(older, first)
    for part in others:  # their rows are redone by this batchjob, with the columns
        part.unlink()
    assert run_job(job, progress, engine_factory=fake_factory()) == EXIT_OK
    table = pq.read_table(out / "data")
    frame = pl.read_parquet(out / "data" / "*.parquet")
    assert table.num_rows == frame.height == 9 and set(table.column_names) == set(frame.columns)
    echoed = {r["id"] for r in table.to_pylist() if r["echo"] is not None}
    assert echoed == {f"c{i}" for i in range(9)} - set(older.column("id").to_pylist())
    assert set(frame.filter(pl.col("echo").is_not_null())["id"]) == echoed


@pytest.mark.parametrize("order", ["completion", "input"])
def test_a_folder_finished_with_parts_of_two_schemas_reads_whole_after_a_rerun(tmp_path, order, progress):
    """A folder that a batchjob finished without giving its parts one schema (one before the prompt columns were
    made whole at the finish): the rerun finds it complete, and must still leave it readable as one dataset."""
    job, out = echo_job(tmp_path, order), tmp_path / "out"
    assert run_job(job, progress, engine_factory=fake_factory()) == EXIT_OK
    first = sorted(out.glob("data/*.parquet"))[0]
    pq.write_table(pq.read_table(first).drop_columns(["prompt_logprobs", "echo"]), first)
    assert "echo" not in pq.read_table(out / "data").column_names  # what a reader of that folder got
    assert run_job(job, progress, engine_factory=fake_factory()) == EXIT_OK
    assert "already complete" in " ".join(progress.messages)
    table = pq.read_table(out / "data")
    assert table.num_rows == 9 and table.column("echo").null_count == 3


def test_a_resume_whose_columns_cannot_join_the_parts_is_refused_before_it_writes(tmp_path, progress):
    """A part whose column has another type than this run writes (a part of another batchjob version): the folder
    could never read as one dataset. Seen: the run computed every row, then failed its finish with an Arrow
    traceback, at every rerun."""
    job, out = echo_job(tmp_path), tmp_path / "out"
    assert run_job(job, progress, engine_factory=fake_factory()) == EXIT_OK
    first, *others = sorted(out.glob("data/*.parquet"))
    older = pq.read_table(first)
    older = older.set_column(older.schema.get_field_index("echo"), "echo", pa.array([[1]] * 3, pa.list_(pa.int8())))
    pq.write_table(older, first)
    for part in others:
        part.unlink()
    (out / "_SUCCESS").unlink()
    conflict = r"column echo: list<element: int8> in part-000000.parquet, string in this run: .* --restart"
    with pytest.raises(StateError, match=conflict):
        run_job(job, progress, engine_factory=fake_factory())
    assert sorted(out.glob("data/*.parquet")) == [first]  # nothing added to a folder that cannot be one dataset
    assert run_job(job, progress, restart=True, engine_factory=fake_factory()) == EXIT_OK
    assert pq.read_table(out / "data").num_rows == 9


def test_cleanup_and_overwrites_touch_only_the_files_that_job_json_names(tmp_path, docs, progress):
    out = tmp_path / "out"
    job = make_job(docs, out)
    assert run_job(job, progress, engine_factory=fake_factory()) == EXIT_OK
    files = json.loads((out / "_job.json").read_text())["files"]
    assert files == ["_SUCCESS", "_summary.json", "_timeline.parquet", "metrics.prom"]  # not output.jsonl: Parquet
    (out / "output.jsonl").write_text("the user's, put here after the job ran\n")
    with pytest.raises(StateError, match="holds output.jsonl, which batchjob's records"):
        run_job(job, progress, restart=True, engine_factory=fake_factory())
    with pytest.raises(StateError, match="holds output.jsonl, which batchjob's records"):
        run_job(job, progress, engine_factory=fake_factory())
    assert (out / "output.jsonl").read_text() == "the user's, put here after the job ran\n"
    assert (out / "_SUCCESS").exists() and len(results(out)) == 23
    (out / "output.jsonl").unlink()
    assert run_job(job, progress, restart=True, engine_factory=fake_factory()) == EXIT_OK and len(results(out)) == 23


def test_a_job_json_from_before_the_files_list_owns_every_name_batchjob_writes(tmp_path, docs, progress):
    out = tmp_path / "out"
    job = make_job(docs, out)
    assert run_job(job, progress, engine_factory=fake_factory()) == EXIT_OK
    meta = json.loads((out / "_job.json").read_text())
    del meta["files"]
    (out / "_job.json").write_text(json.dumps(meta))
    assert run_job(job, progress, restart=True, engine_factory=fake_factory()) == EXIT_OK
    assert len(json.loads((out / "_job.json").read_text())["files"]) == 4 and len(results(out)) == 23


def _changes(path, new: list[dict] | None = None):
    """Ways an input file changes under a running job: each leaves other content where the digest was taken."""
    new = new or documents(6, start=100)
    return {
        "replaced": lambda: os.replace(write_jsonl(path.with_name("new.jsonl"), new), path),
        "appended": lambda: path.write_bytes(path.read_bytes() + json.dumps(new[0]).encode() + b"\n"),
        "truncated": lambda: path.write_bytes(b"".join(path.read_bytes().splitlines(keepends=True)[:2])),
        "edited": lambda: edit_in_place(path, b"w", b"v"),  # same inode and size: only the mtime tells
    }


def edit_in_place(path, old: bytes, new: bytes) -> None:
    mtime = path.stat().st_mtime_ns
    with open(path, "r+b") as f:
        data = f.read()
        f.seek(0)
        f.write(data.replace(old, new))
    os.utime(path, ns=(mtime + 10**9, mtime + 10**9))  # a later write, whatever the filesystem's clock granularity


@pytest.mark.parametrize("change", ["replaced", "appended", "truncated"])
def test_an_input_that_changes_during_the_model_load_stops_the_job_before_any_row(tmp_path, progress, change):
    """Seen: replaced, the results came from the new content under the old digest; appended, exit 70 IndexError;
    truncated, exit 70 "4 of 6 rows got no result"."""
    path = write_jsonl(tmp_path / "in.jsonl", documents(6))

    def load_while_it_changes(job):  # after the digest and the scan, before any row is read
        _changes(path)[change]()
        return fake_factory()(job)

    job = make_job(path, tmp_path / "out", output={"checkpoint_rows": 1})
    with pytest.raises(InputError, match=f"^input changed during the run: {path}$"):
        run_job(job, progress, engine_factory=load_while_it_changes)
    assert results(tmp_path / "out") == {}


@pytest.mark.parametrize("change", ["replaced", "appended", "truncated", "edited"])
def test_an_input_that_changes_mid_read_keeps_only_rows_of_the_content_read(tmp_path, progress, monkeypatch, change):
    from batchjob.job.input.reader import InputSource

    # Lines longer than a read buffer, so that the lines after the change are read from the disk, not a buffer
    docs = [{"id": f"doc-{i}", "text": " ".join(f"w{i}x{k}" for k in range(2000))} for i in range(12)]
    path = write_jsonl(tmp_path / "in.jsonl", docs)
    read = InputSource._json_row
    seen = []

    def row_then_change(self, *args):
        seen.append(args)
        if len(seen) == 12 + 3:  # the scan read all 12 lines; the work pass has read 3 when the file changes
            _changes(path, [{**d, "id": f"new-{d['id']}"} for d in docs])[change]()
        return read(self, *args)

    monkeypatch.setattr(InputSource, "_json_row", row_then_change)
    # A row at a time through the planner and two through the engine: rows read after the change finish (and would
    # be committed) while later lines are still unread
    monkeypatch.setattr(batchjob.job.input.planner, "TOKENIZE_CHUNK", 1)
    job = make_job(path, tmp_path / "out", output={"checkpoint_rows": 1}, schedule={"sort_window": 1})
    with pytest.raises(InputError, match="^input changed during the run"):
        run_job(job, progress, engine_factory=fake_factory(max_model_len=1 << 16, max_num_seqs=2))
    original = {d["id"]: reversed_words(d["text"]) for d in docs}
    committed = {k: r["output"] for k, r in results(tmp_path / "out").items()}
    assert committed and committed.items() <= original.items()  # the rows read before the change, as they were


def test_a_parquet_input_replaced_during_the_model_load_stops_the_job(tmp_path, progress):
    path = write_parquet(tmp_path / "in.parquet", documents(6))

    def load_while_it_changes(job):
        os.replace(write_parquet(tmp_path / "new.parquet", documents(6, start=100)), path)
        return fake_factory()(job)

    with pytest.raises(InputError, match=f"^input changed during the run: {path}$"):
        run_job(make_job(path, tmp_path / "out"), progress, engine_factory=load_while_it_changes)
    assert results(tmp_path / "out") == {}
