"""Kill a run at every filesystem operation of its commit path, resume, and check that every row is there once.

The run is forked (a fresh process per crash point, no interpreter start-up); in the child, each os.replace, os.fsync,
rename and unlink counts as one operation, and at the N-th the child signals itself. N goes from 1 until a run gets
through without reaching N, so every step of the commit path, `order: input`'s publish included, is a crash point.
Generation runs on the fake engine; scoring jobs and OpenAI Batch scoring lines on the real default model, loaded
once in this process (the session's engine) and shared by every forked run.

A child forked from pytest inherits locks that other tests' threads (Ray, moto's server, polars' pool) held at that
moment, and can hang on one: a run that outlives HANG_SECONDS is killed and run again once, so that artifact of
forking a threaded test process neither hangs the suite nor passes unnoticed twice in a row."""

import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from batchjob.job.output.state import OutputDir
from batchjob.job.output.storage import TMP_PREFIX
from batchjob.job.run.runner import run_job
from tests.helpers import Messages, documents, fake_factory, make_job, write_jsonl, write_parquet
from tests.job.test_openai_scoring import chat, completion

OPS = [(os, "replace"), (os, "fsync"), (Path, "rename"), (Path, "unlink")]
HANG_SECONDS = 60  # a run of 7 rows on the fake engine takes well under a second, of 4 short rows on the model seconds
FAKE = fake_factory()
TOL = 2e-5  # float32 sums in another order: a resumed run batches and chunks its rows otherwise (as test_score_jobs)


def run_forked(job, crash_at: int | None, signum: int, engine_factory=FAKE, tries: int = 2) -> tuple[int, bool]:
    """Run `job` in a child; returns (its exit status, whether it reached the crash point)."""
    reached = Path(job.output.path).with_name("crash-point-reached")
    reached.unlink(missing_ok=True)
    pid = os.fork()
    if pid == 0:
        count = 0
        try:
            # GNU OpenMP's thread pool does not survive a fork: a child that runs torch on more than one thread waits
            # forever on the parent's pool threads, which it does not have.
            torch.set_num_threads(1)
            for owner, name in OPS:
                real = getattr(owner, name)

                def counted(*a, _real=real, **k):
                    nonlocal count
                    count += 1
                    if count == crash_at:
                        reached.touch()
                        os.kill(os.getpid(), signum)
                    return _real(*a, **k)

                setattr(owner, name, counted)
            code = run_job(job, Messages(), grace=0.0, engine_factory=engine_factory)
        except BaseException:
            code = 99
        os._exit(code)
    deadline = time.monotonic() + HANG_SECONDS
    while (waited := os.waitpid(pid, os.WNOHANG))[0] == 0:
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            assert tries > 1, f"a run hung twice (crash point {crash_at})"
            return run_forked(job, crash_at, signum, engine_factory, tries - 1)  # resumes what the hung run left
        time.sleep(0.01)
    status = waited[1]
    return (-os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)), reached.exists()


def generated(row: dict):
    return row["output"], row["error"]


def rows_by_id(out: Path, values: Callable[[dict], object] = generated) -> dict:
    table = pq.read_table(out / "data")
    ids = table.column("id").to_pylist()
    assert len(ids) == len(set(ids)), "a row was committed twice"
    return {r["id"]: values(r) for r in table.to_pylist()}


def counts(out: Path) -> tuple:
    """What _summary.json and `batchjob status` count of a finished folder."""
    summary = json.loads((out / "_summary.json").read_text())
    status = OutputDir(out).status()
    assert status["state"] == "done" and status["rows_done"] == summary["rows_total"], status
    assert status["rows_failed"] == summary["rows_failed"], status
    return summary["rows_total"], summary["rows_ok"], summary["rows_failed"], summary["prompt_tokens"]


def sweep(
    tmp_path: Path,
    job_at: Callable[[Path], object],
    signum: int,
    values: Callable[[dict], object] = generated,
    engine_factory=FAKE,
    tol: float = 0,
) -> int:
    """Kill the run of job_at(folder) at each crash point in turn and resume it: every row once with the values of an
    uninterrupted run (numbers within `tol`), the same counts, no temporary file left. Returns the crash points'
    number."""
    reference = tmp_path / "reference"
    assert run_forked(job_at(reference), None, signum, engine_factory) == (0, False)
    expected, expected_counts = rows_by_id(reference, values), counts(reference)
    n = 0
    while True:
        n += 1
        out = tmp_path / f"out-{n}"
        job = job_at(out)
        code, crashed = run_forked(job, n, signum, engine_factory)
        if not crashed:
            assert code == 0
            break
        assert code in (-signum, 0, 143), (n, code)  # killed, finished, or stopped by the SIGTERM handler
        assert run_forked(job, None, signum, engine_factory) == (0, False), n
        got = rows_by_id(out, values)
        assert got.keys() == expected.keys(), n
        assert all(got[k] == pytest.approx(v, abs=tol) for k, v in expected.items()), n
        assert counts(out) == expected_counts, n
        assert not [p for p in out.rglob(f"{TMP_PREFIX}*")], n
        if job.output.order == "input":
            assert all(p.name.startswith("sorted-") for p in (out / "data").iterdir()), n
    return n


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM])
@pytest.mark.parametrize("order", ["completion", "input"])
def test_a_run_killed_at_any_commit_step_resumes_to_the_same_rows_exactly_once(tmp_path, signum, order):
    docs = write_parquet(tmp_path / "docs.parquet", documents(7))
    output = {"checkpoint_rows": 3, "order": order, "rows_per_file": 4}
    assert sweep(tmp_path, lambda out: make_job(docs, out, output=output), signum) > 10  # the commit path was walked


def scored(row: dict) -> tuple:
    """A scored row's values, flat (pytest.approx compares no nested ones): its text, counts and logprobs."""
    per_token = [t["logprob"] for t in row.get("token_logprobs") or []]
    prompt = [e["logprob"] for e in row.get("prompt_logprobs") or []]
    texts = row["error"], row.get("output"), row.get("echo"), row.get("label")
    return (
        *texts,
        row["prompt_tokens"],
        row.get("scored_tokens"),
        *per_token,
        *(row.get("label_logprobs") or []),
        *prompt,
    )


MODEL = "smollm2-135m-instruct"  # the session's engine answers; the job names the model it is


@pytest.mark.parametrize("what", ["continuation", "labels"])
def test_a_scoring_job_killed_at_any_commit_step_resumes_to_the_same_scores_exactly_once(tmp_path, engine, what):
    rows = [
        {"id": "paris", "text": "The capital of France is", "answer": " Paris."},
        {"id": "rome", "text": "The capital of France is", "answer": " Rome."},
        {"id": "food", "text": "The food was wonderful and the staff were kind.", "answer": " Yes."},
        {"id": "bad", "text": "", "answer": None},  # an error row is committed and resumed as the others
    ]
    data = write_parquet(tmp_path / "rows.parquet", rows)
    score = (
        {"continuation_column": "answer", "prompt_logprobs": 1} if what == "continuation" else {"labels": [" a", " b"]}
    )
    # order: input for one of the two, so that the publish of the sorted files is swept too
    output = {"checkpoint_rows": 2, "order": "input" if what == "labels" else "completion", "rows_per_file": 2}

    def job_at(out: Path):
        return make_job(data, out, model=MODEL, task="score", sampling=None, score=score, output=output)

    tol = TOL if what == "continuation" else 1e-4  # a label's logprob is a sum (as test_score_jobs compares it)
    assert sweep(tmp_path, job_at, signal.SIGKILL, scored, lambda job: engine, tol) > 5


def test_openai_batch_scoring_lines_killed_at_any_commit_step_resume_exactly_once(tmp_path, engine):
    lines = [
        completion("echo", "The capital of France is Paris.", echo=True, logprobs=2, max_tokens=0),
        completion("echo-2", echo=True, logprobs=0, max_tokens=0),
        completion("vllm", "The capital of Italy is Rome.", prompt_logprobs=1, max_tokens=0),
        chat("chat", prompt_logprobs=0, max_tokens=0),
        completion("bad", prompt_logprobs=21, max_tokens=0),
    ]
    data = write_jsonl(tmp_path / "batch.jsonl", lines)

    def job_at(out: Path):
        return make_job(
            data,
            out,
            model=MODEL,
            input={"format": "openai-batch"},
            output={"format": "openai-batch", "checkpoint_rows": 2},
        )

    assert sweep(tmp_path, job_at, signal.SIGKILL, scored, lambda job: engine, tol=TOL) > 5
    for out in tmp_path.glob("out-*"):  # the response file too: one line a request
        ids = [json.loads(line)["custom_id"] for line in (out / "output.jsonl").read_text().splitlines()]
        assert sorted(ids) == sorted(line["custom_id"] for line in lines), out
