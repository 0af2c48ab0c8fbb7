"""`executor: ray` on a local Ray instance that the tests start (two CPUs, two workers): the fake engine for the paths
of a run (bad rows, a worker that dies, a signal, resume), then the real model, whose results on Ray, across a driver
killed with -9 and a resume, equal a local run's. Each Ray run starts its actors anew (seconds each), so there are
few. Ray is an optional extra: without it these tests skip, and the clear failure of `executor: ray` is checked."""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml

from batchjob.job.exit_codes import EXIT_OK, EXIT_ROW_ERRORS
from batchjob.job.input.reader import InputSource
from batchjob.job.output.state import OutputDir
from batchjob.job.run.executor import load_engine
from batchjob.job.run.runner import run_job
from batchjob.job.spec import JobFileError, load_job
from tests.fakes import FakeEngine
from tests.helpers import REPO, SAMPLE_DATA, Messages, documents, fake_factory, make_job, short_documents, write_parquet
from tests.job.test_runner import results

RAY = {"num_workers": 2, "shard_rows": 3}


@pytest.fixture(scope="module")
def cluster():
    """The local Ray instance of this module; its address lets a CLI subprocess join it as a driver."""
    ray = pytest.importorskip("ray", reason="Ray is an optional extra: pip install -e '.[ray]'")
    pytest.importorskip("ray.data", reason="Ray Data is an optional extra: pip install -e '.[ray]'")
    ray.init(num_cpus=2, logging_level="WARNING")
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


def outputs(rows: dict) -> dict:
    return {k: (r["output"], r["error"], r["prompt_tokens"], r["truncated"], r["row_index"]) for k, r in rows.items()}


def with_stream(make_stream, **config):
    """An engine factory whose fake engine streams through make_stream(engine's own stream, requests)."""

    def factory(job):
        engine = FakeEngine(job.model, **config)
        stream = engine.stream
        engine.stream = lambda requests: make_stream(stream, requests)
        return engine

    return factory


def test_executor_ray_without_ray_fails_with_a_clear_message(tmp_path, progress, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # what `import ray` meets where the extra is not installed
    monkeypatch.delitem(sys.modules, "batchjob.job.run.ray_executor", raising=False)
    job = make_job(write_parquet(tmp_path / "d.parquet", documents(3)), tmp_path / "out", executor="ray")
    with pytest.raises(JobFileError, match=r"executor: 'ray' needs Ray.*pip install 'batchjob\[ray\]'"):
        run_job(job, progress, engine_factory=fake_factory())
    assert not (tmp_path / "out").exists()


def test_a_ray_run_writes_what_a_local_run_writes_though_a_worker_dies(tmp_path, progress, cluster):
    marker = tmp_path / "died"

    def die_on_the_first_shard(stream, requests):
        if not marker.exists():
            marker.touch()
            os._exit(1)
        yield from stream(requests)

    for name, factory in (
        ("local", fake_factory(max_model_len=64)),
        ("ray", with_stream(die_on_the_first_shard, max_model_len=64)),
    ):
        job = make_job(
            SAMPLE_DATA / "bad_rows.jsonl",
            tmp_path / name,
            executor=name,
            ray=RAY,
            prompt={"template": "Summarize:\n\n{text}", "on_too_long": "truncate_right"},
            output={"checkpoint_rows": 4},
            fail_on_row_errors=True,
        )
        assert run_job(job, progress, engine_factory=factory) == EXIT_ROW_ERRORS
    assert marker.exists()  # a worker died, and Ray gave its shard to a worker that came up in its place
    local, distributed = results(tmp_path / "local"), results(tmp_path / "ray")
    assert len(local) == 11 and outputs(distributed) == outputs(local)
    assert sum(r["error"] is None for r in local.values()) == 4
    assert sorted(p.name for p in (tmp_path / "ray" / "data").iterdir()) == [f"part-{i:06d}.parquet" for i in range(3)]
    status = OutputDir(tmp_path / "ray").status()
    assert status["state"] == "done" and status["rows_done"] == 11 and status["rows_failed"] == 7


def test_a_signal_stops_the_driver_and_a_rerun_resumes_without_writing_any_row_twice(tmp_path, progress, cluster):
    docs = write_parquet(tmp_path / "docs.parquet", documents(12))
    reference = tmp_path / "reference"
    run_job(make_job(docs, reference), progress, engine_factory=fake_factory())

    def slow(stream, requests):
        for output in stream(requests):
            time.sleep(0.3)
            yield output

    job = make_job(docs, tmp_path / "out", executor="ray", ray={**RAY, "shard_rows": 2}, output={"checkpoint_rows": 1})
    out = OutputDir(tmp_path / "out")

    def signal_after_the_first_commit():
        while not (out.data.exists() and out.parts()):
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=signal_after_the_first_commit, daemon=True).start()
    assert run_job(job, progress, engine_factory=with_stream(slow)) == 143
    assert progress.messages[-1].startswith("interrupted:")
    partial = results(out.path)
    assert 0 < len(partial) < 12 and out.status()["state"] == "stopped (resumable)"

    assert run_job(job, progress, engine_factory=fake_factory()) == EXIT_OK
    assert f"resuming: {len(partial)} of 12 rows already done" in progress.messages
    assert outputs(results(out.path)) == outputs(results(reference))


def test_the_driver_streams_the_input_with_bounded_rows_in_flight(tmp_path, progress, cluster, monkeypatch):
    read, in_flight = [0], []
    rows = InputSource.rows

    def counted(self):
        for row in rows(self):
            read[0] += 1
            yield row

    class Committed(Messages):
        committed = 0

        def rows(self, n, **tokens):
            super().rows(n, **tokens)
            self.committed += n
            in_flight.append(read[0] - self.committed)

    monkeypatch.setattr(InputSource, "rows", counted)
    docs = write_parquet(tmp_path / "docs.parquet", documents(40))
    job = make_job(docs, tmp_path / "out", executor="ray", ray=RAY)
    assert run_job(job, Committed(), engine_factory=fake_factory()) == EXIT_OK
    assert len(results(tmp_path / "out")) == 40 and read[0] == 40
    # one shard a worker in flight and one in the driver's hand, not the whole input before the first shard runs
    assert max(in_flight) <= (RAY["num_workers"] + 1) * RAY["shard_rows"]


def test_the_job_file_and_the_command_line_choose_the_executor(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(
        "input: {path: d.parquet}\noutput: {path: out}\nexecutor: ray\nray: {num_workers: 0, num_cpu_per_worker: 2}\n"
    )
    result = cli("run", str(job), "--executor", "local")
    assert result.returncode == 2
    assert "ray.num_workers: Input should be greater than or equal to 1" in result.stderr
    assert "ray.num_cpu_per_worker: unknown key; allowed: address, num_cpus_per_worker" in result.stderr
    result = cli("run", str(job), "--executor", "slurm")
    assert result.returncode == 2 and "'slurm' is not one of 'local', 'ray'" in result.stderr


# --- the real model

ROWS = 8
ENGINE = {"max_num_seqs": 4, "kv_cache_memory_gb": 0.05, "max_model_len": 256}


def cli(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "batchjob.cli", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def write_job(path: Path, data: Path, out: Path) -> Path:
    path.write_text(
        yaml.safe_dump(
            {
                "input": {"path": str(data), "passthrough": ["title"]},
                "prompt": {"system": "You write one short sentence.", "template": "Summarize:\n\n{text}"},
                "sampling": {"temperature": 0.0, "max_tokens": 8},
                "engine": ENGINE,
                "ray": {**RAY, "shard_rows": 2},
                "output": {"path": str(out), "checkpoint_rows": 2, "checkpoint_seconds": 1},
            }
        )
    )
    return path


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return short_documents(tmp_path_factory.mktemp("ray"), ROWS, 24)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data) -> dict:
    """A local run of the job, in this process."""
    tmp = tmp_path_factory.mktemp("local")
    assert (
        run_job(load_job(write_job(tmp / "job.yaml", data, tmp / "out")), Messages(), engine_factory=load_engine)
        == EXIT_OK
    )
    return results(tmp / "out")


@pytest.mark.slow
def test_real_model_on_ray_gives_the_local_outputs_across_a_killed_driver(tmp_path, cluster, data, reference):
    job = str(write_job(tmp_path / "job.yaml", data, tmp_path / "out"))
    out = OutputDir(tmp_path / "out")
    env = {**os.environ, "RAY_ADDRESS": cluster}  # the driver joins this module's Ray instance
    with open(tmp_path / "killed.log", "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "batchjob.cli", "run", job, "--executor", "ray"],
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    while not (out.data.exists() and out.parts()) and proc.poll() is None:
        time.sleep(0.05)
    proc.kill()
    proc.wait(30)
    assert proc.returncode == -signal.SIGKILL, (tmp_path / "killed.log").read_text()
    done = len(results(out.path))
    assert 0 < done < ROWS and out.status()["state"] == "stopped (killed; resumable)"

    final = cli("run", job, "--executor", "ray", env=env)
    assert final.returncode == 0, final.stdout + final.stderr
    assert "took over the lock of a run that is gone" in final.stdout
    assert f"resuming: {done} of {ROWS} rows already done" in final.stdout
    rows = results(out.path)
    assert outputs(rows) == outputs(reference) and all(r["output_tokens"] > 0 for r in rows.values())
    assert {k: r["title"] for k, r in rows.items()} == {k: r["title"] for k, r in reference.items()}
    again = cli("run", job, "--executor", "ray", env=env)
    assert again.returncode == 0 and "already complete" in again.stdout


@pytest.mark.slow
def test_an_embedding_job_on_ray_writes_the_local_runs_embeddings(tmp_path, cluster, minilm, embed_texts):
    rows = [{"id": f"t{i}", "text": text, "n": i} for i, text in enumerate(embed_texts)]
    data = write_parquet(tmp_path / "texts.parquet", rows)

    def job(folder: str, **extra):
        spec = {
            "task": "embed",
            "model": str(minilm),
            "input": {"path": str(data), "passthrough": ["n"]},
            "engine": {"dtype": "float32"},
            "output": {"path": str(tmp_path / folder), "checkpoint_rows": 7},
            **extra,
        }
        (tmp_path / f"{folder}.yaml").write_text(yaml.safe_dump(spec))
        return load_job(tmp_path / f"{folder}.yaml")

    assert run_job(job("local"), Messages(), engine_factory=load_engine) == EXIT_OK
    on_ray = job("ray", executor="ray", ray={"num_workers": 2, "shard_rows": 10})
    assert run_job(on_ray, Messages(), engine_factory=load_engine) == EXIT_OK
    local, ray_rows = results(tmp_path / "local"), results(tmp_path / "ray")
    assert sorted(ray_rows) == sorted(local) == sorted(r["id"] for r in rows)
    for key, row in local.items():
        other = ray_rows[key]
        assert (other["error"], other["prompt_tokens"], other["truncated"], other["n"]) == (
            row["error"],
            row["prompt_tokens"],
            row["truncated"],
            row["n"],
        )
        if row["error"] is None:
            assert float(np.dot(row["embedding"], other["embedding"])) > 0.99999


@pytest.mark.slow
def test_a_scoring_job_on_ray_writes_the_local_runs_scores(tmp_path, cluster, data):
    rows = pq.read_table(data).to_pylist()
    answers = write_parquet(
        tmp_path / "qa.parquet",
        [{"id": r["id"], "text": r["title"], "answer": " " + r["text"]} for r in rows] + [{"id": "x", "text": "t"}],
    )

    def job(folder: str, **extra):
        spec = {
            "task": "score",
            "input": {"path": str(answers)},
            "prompt": {"template": "Title: {text}\nText:"},
            "score": {"continuation_column": "answer", "prompt_logprobs": 1},
            "engine": {**ENGINE, "dtype": "float32"},
            "output": {"path": str(tmp_path / folder), "checkpoint_rows": 3},
            **extra,
        }
        (tmp_path / f"{folder}.yaml").write_text(yaml.safe_dump(spec))
        return load_job(tmp_path / f"{folder}.yaml")

    assert run_job(job("local"), Messages(), engine_factory=load_engine) == EXIT_OK
    assert run_job(job("ray", executor="ray", ray=RAY), Messages(), engine_factory=load_engine) == EXIT_OK
    local, on_ray = results(tmp_path / "local"), results(tmp_path / "ray")
    assert sorted(on_ray) == sorted(local) and len(local) == ROWS + 1
    assert "missing continuation: answer is missing or null" in on_ray["x"]["error"]
    for key, row in local.items():
        other = on_ray[key]
        assert (other["error"], other["prompt_tokens"], other["scored_tokens"]) == (
            row["error"],
            row["prompt_tokens"],
            row["scored_tokens"],
        )
        if row["error"] is None:
            assert other["sum_nll"] == pytest.approx(row["sum_nll"], abs=1e-4 * row["scored_tokens"])
            assert [t["token"] for t in other["token_logprobs"]] == [t["token"] for t in row["token_logprobs"]]


@pytest.mark.slow
def test_a_ray_run_of_a_job_with_labels_counts_the_tokens_a_local_run_counts(tmp_path, cluster):
    """Seen: a Ray run's progress line showed negative prompt tokens for a scoring job with labels. It took each
    row's prompt_tokens less its cached_tokens, which counts every label's read of the prompt from the prefix cache
    (and a duplicate row's whole work); a local run counts the tokens each work computed."""
    review = "the film was long and slow, the actors seemed tired, yet the last scene in the rain was rather moving"
    texts = [review, review, "a loud and empty sequel that nobody asked for, with jokes that land nowhere at all"]
    data = write_parquet(tmp_path / "r.parquet", [{"id": f"r{i}", "text": t} for i, t in enumerate(texts)])

    def run(folder: str, **extra) -> Messages:
        spec = {
            "task": "score",
            "input": {"path": str(data)},
            "prompt": {"template": "Review: {text}\nSentiment:"},
            "score": {"labels": [" positive", " negative", " mixed"]},
            "engine": {**ENGINE, "dtype": "float32"},
            "output": {"path": str(tmp_path / folder)},
            **extra,
        }
        (tmp_path / f"{folder}.yaml").write_text(yaml.safe_dump(spec))
        progress = Messages()
        assert run_job(load_job(tmp_path / f"{folder}.yaml"), progress, engine_factory=load_engine) == EXIT_OK
        return progress

    local = run("local").stats
    on_ray = run("ray", executor="ray", ray={"num_workers": 2, "shard_rows": 2}).stats  # the duplicate in one shard
    rows = results(tmp_path / "ray")
    assert any(r["cached_tokens"] > r["prompt_tokens"] for r in rows.values())  # the labels read the prompt
    assert (on_ray.rows, on_ray.prompt_tokens, on_ray.output_tokens) == (local.rows, local.prompt_tokens, 0)
    assert local.prompt_tokens > 0
