"""Input from and output to S3, against a real S3 API: moto's server on 127.0.0.1 (started here, on a free port),
reached through s3fs with the endpoint and credentials from the standard AWS environment variables. The runs are
the CLI on the real model, as subprocesses: kill -9 twice mid-run and a resume give every id exactly once, and a
second run is refused while the first holds the lease. On the fake engine, through the CLI: a run killed before or
after any S3 write (part uploads, the publish, the lease's create, renewal and release) resumes to every row once, a
run that loses its lease stops committing and exits 75, and of two runs racing for one lease one wins, one exits 75."""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from batchjob.job.input.reader import InputSource
from batchjob.job.output import lease as lease_module
from batchjob.job.output.lease import LeaseLost
from batchjob.job.output.lock import LockHeld
from batchjob.job.output.state import OutputDir, StateError
from batchjob.job.run.runner import run_job
from tests.helpers import REPO, Messages, documents, fake_factory, make_job, short_documents, write_jsonl, write_parquet

s3fs = pytest.importorskip("s3fs", reason="the S3 tests need the test extra (s3fs, moto[server])")
moto_server = pytest.importorskip("moto.server", reason="the S3 tests need the test extra (moto[server])")

BUCKET = "batchjob-test"
ROWS = 12


@pytest.fixture(scope="module")
def s3():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    # moto keeps its buckets in this process, across servers: another module's server left its objects there.
    urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/moto-api/reset", method="POST")).close()
    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    s3fs.S3FileSystem.clear_instance_cache()  # an earlier instance would keep an earlier endpoint
    fs = s3fs.S3FileSystem()
    fs.mkdir(BUCKET)
    yield fs
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    s3fs.S3FileSystem.clear_instance_cache()
    server.stop()


def results(fs, url: str) -> list[dict]:
    fs.invalidate_cache()
    parts = fs.glob(f"{url.removeprefix('s3://')}/data/*.parquet")
    return [r for p in parts for r in pq.read_table(p, filesystem=fs).to_pylist()]


def test_parquet_and_jsonl_inputs_on_s3_to_outputs_on_s3(s3, tmp_path, progress):
    rows = documents(20)
    s3.put(str(write_parquet(tmp_path / "in.parquet", rows, row_group_size=7)), f"{BUCKET}/in/docs.parquet")
    for k in range(2):
        s3.put(str(write_jsonl(tmp_path / f"{k}.jsonl", rows[k * 10 : k * 10 + 10])), f"{BUCKET}/in/part-{k}.jsonl")
    for name, src in [("pq", f"s3://{BUCKET}/in/docs.parquet"), ("jsonl", f"s3://{BUCKET}/in/part-*.jsonl")]:
        url = f"s3://{BUCKET}/out-{name}"
        job = make_job(src, url, output={"checkpoint_rows": 3}, input={"passthrough": ["title"]})
        assert run_job(job, progress, engine_factory=fake_factory()) == 0
        got = results(s3, url)
        assert sorted(r["id"] for r in got) == sorted(r["id"] for r in rows)
        assert all(r["error"] is None and r["title"] for r in got)
        for name_ in ("_SUCCESS", "_summary.json", "_job.json"):
            assert s3.exists(f"{url.removeprefix('s3://')}/{name_}")
        assert not s3.exists(f"{url.removeprefix('s3://')}/_lock")  # released at the end
        status = OutputDir(url).status()
        assert status["state"] == "done" and status["rows_done"] == 20 and status["folder"] == url
        meta = json.loads(s3.cat_file(f"{url.removeprefix('s3://')}/_job.json"))
        assert all(f["path"].startswith(f"s3://{BUCKET}/in/") for f in meta["fingerprint"]["input"]["files"])
        # Done, same job: nothing to do; the lease is taken and given back.
        assert run_job(job, progress, engine_factory=fake_factory()) == 0
        assert "already complete" in progress.messages[-1]


def test_a_recursive_glob_that_covers_the_output_folder_reruns_after_a_stop_and_when_finished(s3, tmp_path, progress):
    s3.put(str(write_parquet(tmp_path / "in.parquet", documents(23), row_group_size=8)), f"{BUCKET}/D/a/docs.parquet")
    url = f"s3://{BUCKET}/D/summaries"
    job = make_job(f"s3://{BUCKET}/D/**/*.parquet", url, output={"checkpoint_rows": 4})
    assert run_job(job, progress, engine_factory=fake_factory(signal_at=(5,))) == 143
    s3.invalidate_cache()
    # What the glob matches now: the job's own parts and timeline, none of them input.
    assert {p.rsplit("/", 1)[-1] for p in s3.glob(f"{BUCKET}/D/**/*.parquet")} > {"docs.parquet", "_timeline.parquet"}
    for _ in range(2):  # a resume that finishes, then a rerun of the finished job
        assert run_job(job, progress, engine_factory=fake_factory()) == 0
        assert sorted(rows_once(s3, url)) == [doc["id"] for doc in documents(23)]
    assert "already complete" in progress.messages[-1]
    meta = json.loads(s3.cat_file(f"{BUCKET}/D/summaries/_job.json"))
    assert [f["path"] for f in meta["fingerprint"]["input"]["files"]] == [f"s3://{BUCKET}/D/a/docs.parquet"]


@pytest.fixture
def lease_clock(monkeypatch):
    """The leases' clock, stopped and moved by the test: a lease expires when the test says, not when a loaded host
    happens to fall behind a 1 s deadline."""

    class Clock:
        t = time.time()

        def __call__(self) -> float:
            return self.t

    clock = Clock()
    monkeypatch.setattr(lease_module, "now", clock)
    return clock


def wait_for(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_run_is_refused_while_another_holds_the_lease_and_takes_over_an_expired_one(
    s3, tmp_path, progress, lease_clock
):
    url = f"s3://{BUCKET}/leased"
    data = write_parquet(tmp_path / "in.parquet", documents(5))
    job = make_job(data, url, output={"lease_seconds": 1.0})
    holder = OutputDir(url, lease_seconds=1.0)
    with holder.lock() as lease:
        taken = lease.valid_until
        lease_clock.t += 0.9
        wait_for(lambda: lease.valid_until >= taken + 0.9)  # the renewal thread's own renewal, however late it runs
        lease_clock.t += 0.6  # past the first lease's expiry: the renewed one holds
        with pytest.raises(LockHeld, match="in use by another run"):
            run_job(job, progress, engine_factory=fake_factory())
        assert holder.status()["state"] == "running"
    # A lease left by a dead run (never renewed) is taken over once it has expired.
    lease = {"pid": 1, "host": "elsewhere", "started": "2026-01-01T00:00:00+00:00", "token": "dead", "expires": 0}
    s3.pipe_file(f"{BUCKET}/leased/_lock", json.dumps(lease).encode())
    assert not OutputDir(url).status()["state"].startswith("running")
    assert run_job(job, progress, engine_factory=fake_factory()) == 0
    assert any("took over the lock" in m for m in progress.messages)


def test_a_lease_taken_by_another_run_is_never_overwritten_by_a_renewal_nor_deleted_by_the_release(s3):
    other = {"pid": 1, "host": "other", "started": "2026-01-01T00:00:00+00:00", "token": "other", "expires": 2e9}
    held = OutputDir(f"s3://{BUCKET}/stolen", lease_seconds=0.4)
    with pytest.raises(LeaseLost, match="another run took over this run's lease"), held.lock() as lease:
        s3.pipe_file(f"{BUCKET}/stolen/_lock", json.dumps(other).encode())  # as a run that took it over would
        wait_for(lambda: lease.lost)  # the next renewal is conditional on the version this run wrote, so fails
        held.check_held()
    assert json.loads(s3.cat_file(f"{BUCKET}/stolen/_lock")) == other


def test_a_run_that_cannot_renew_its_lease_stops_committing_before_it_expires(s3, monkeypatch, lease_clock):
    held = OutputDir(f"s3://{BUCKET}/cut-off", lease_seconds=0.4)
    with held.lock() as lease:

        def unreachable(*args, **kwargs):
            raise OSError(errno.ECONNREFUSED, "the store is unreachable")

        monkeypatch.setattr(lease.object, "replace", unreachable)  # the network, not the lease, fails here
        held.check_held()  # the lease just taken still has more than half its time
        lease_clock.t += 0.25
        with pytest.raises(LeaseLost, match="could not renew its lease"):
            held.check_held()
        monkeypatch.undo()
    assert not s3.exists(f"{BUCKET}/cut-off/_lock")  # released: the version it wrote was still there


def test_an_output_folder_on_a_store_without_conditional_writes_is_refused_in_one_line():
    with pytest.raises(StateError, match=r"memory:// is not supported; batchjob's lease needs S3's conditional"):
        OutputDir("memory://bucket/out").lock()


@pytest.mark.parametrize("restart", [True, False])
def test_an_unrecorded_folder_of_the_users_files_is_left_untouched_on_s3(s3, tmp_path, progress, restart):
    url = f"s3://{BUCKET}/users-{restart}"
    mine = {name: f"the user's {name}".encode() for name in ("output.jsonl", "metrics.prom", "_summary.json")}
    for name, data in mine.items():
        s3.pipe_file(f"{BUCKET}/users-{restart}/{name}", data)
    job = make_job(write_parquet(tmp_path / "in.parquet", documents(3)), url)
    with pytest.raises(StateError, match="do not name as its own"):
        run_job(job, progress, restart=restart, engine_factory=fake_factory())
    s3.invalidate_cache()
    assert {name: s3.cat_file(f"{BUCKET}/users-{restart}/{name}") for name in mine} == mine
    assert not s3.exists(f"{BUCKET}/users-{restart}/_job.json")


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_an_input_object_replaced_during_the_model_load_stops_the_job(s3, tmp_path, progress, fmt):
    from batchjob.job.input.reader import InputError

    key = f"{BUCKET}/changing/in.{fmt}"
    write = write_parquet if fmt == "parquet" else write_jsonl
    s3.put(str(write(tmp_path / f"old.{fmt}", documents(4))), key)

    def load_while_it_changes(job):
        s3.put(str(write(tmp_path / f"new.{fmt}", documents(4, start=10))), key)
        return fake_factory()(job)

    job = make_job(f"s3://{key}", tmp_path / "out")
    with pytest.raises(InputError, match=f"^input changed during the run: s3://{key}$"):
        run_job(job, progress, engine_factory=load_while_it_changes)
    assert not list((tmp_path / "out" / "data").iterdir())


@pytest.mark.slow
def test_kill_9_twice_mid_run_then_resume_gives_every_id_exactly_once(s3, tmp_path):
    data = short_documents(tmp_path, ROWS, 30)
    url = f"s3://{BUCKET}/killed"
    job = {
        "input": {"path": str(data)},
        "sampling": {"temperature": 0.0, "max_tokens": 12},
        "engine": {"max_num_seqs": 4, "kv_cache_memory_gb": 0.1, "max_model_len": 512},
        "output": {"path": url, "checkpoint_rows": 2, "checkpoint_seconds": 1, "lease_seconds": 2},
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    cmd = [sys.executable, "-m", "batchjob.cli", "run", str(tmp_path / "job.yaml"), "--log-interval", "0.2"]
    killed_mid_run = 0
    for attempt in range(2):
        before = len(results(s3, url))
        with open(tmp_path / f"kill{attempt}.log", "w") as log:
            proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 180
        while len(results(s3, url)) == before and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        killed_mid_run += len(results(s3, url)) < ROWS
        time.sleep(2.5)  # the dead run's lease expires
    assert killed_mid_run, "no kill landed in the middle of the run"
    final = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert final.returncode == 0, final.stdout + final.stderr
    ids = [r["id"] for r in results(s3, url)]
    assert len(ids) == len(set(ids)) == ROWS, "an id is missing or written twice"
    assert all(r["error"] is None and r["output_tokens"] > 0 for r in results(s3, url))
    status = subprocess.run(
        [sys.executable, "-m", "batchjob.cli", "status", url], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert status.returncode == 0 and ": done" in status.stdout and f"{ROWS} of {ROWS} done" in status.stdout
    assert Path(tmp_path / "kill0.log").exists()


@pytest.mark.slow
def test_ray_workers_read_their_shards_from_s3_and_a_stop_and_resume_commit_every_id_once(
    s3, tmp_path, progress, monkeypatch
):
    ray = pytest.importorskip("ray", reason="Ray is an optional extra: pip install -e '.[ray]'")
    from tests.job.test_ray import outputs, with_stream

    rows = documents(30) + [{"id": "no-text", "title": "t", "source": "s", "text": None}]
    local = write_parquet(tmp_path / "docs.parquet", rows, row_group_size=7)
    s3.put(str(local), f"{BUCKET}/ray-in/docs.parquet")
    reference = tmp_path / "reference"
    assert run_job(make_job(local, reference), progress, engine_factory=fake_factory()) == 0
    expected = {r["id"]: r for r in pq.read_table(reference / "data").to_pylist()}

    read_by_driver, rows_between = [], InputSource.rows_between

    def counted(self, start, stop):  # every Parquet row read in this process, the driver (Ray workers are others)
        for row in rows_between(self, start, stop):
            read_by_driver.append(row.id)
            yield row

    monkeypatch.setattr(InputSource, "rows_between", counted)
    url = f"s3://{BUCKET}/ray-out"
    job = make_job(
        f"s3://{BUCKET}/ray-in/*.parquet",
        url,
        executor="ray",
        ray={"num_workers": 2, "shard_rows": 4},
        output={"checkpoint_rows": 1},
    )
    marker = tmp_path / "died"

    def slow_and_one_worker_dies(stream, requests):
        if not marker.exists():
            marker.touch()
            os._exit(1)  # Ray restarts the worker and gives it the shard again
        for output in stream(requests):
            time.sleep(0.2)
            yield output

    def stop_after_the_first_commit():
        while not results(s3, url):
            time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGTERM)

    started = not ray.is_initialized()
    if started:  # after the s3 fixture set the AWS environment, so that the workers have it too
        ray.init(num_cpus=2, logging_level="WARNING")
    try:
        threading.Thread(target=stop_after_the_first_commit, daemon=True).start()
        assert run_job(job, progress, engine_factory=with_stream(slow_and_one_worker_dies)) == 143
        partial = results(s3, url)
        assert marker.exists() and 0 < len(partial) < len(rows)
        assert run_job(job, progress, engine_factory=fake_factory()) == 0
        assert f"resuming: {len(partial)} of {len(rows)} rows already done" in progress.messages
    finally:
        if started:
            ray.shutdown()
    got = results(s3, url)
    assert sorted(r["id"] for r in got) == sorted(expected)  # every id exactly once
    assert outputs({r["id"]: r for r in got}) == outputs(expected)
    assert {r["id"]: r["error"] for r in got}["no-text"] == "missing prompt: text is missing or null"
    assert read_by_driver == []  # the workers read their rows from S3 themselves


# A run of the CLI (its error handling and exit codes) on the fake engine, in a fresh interpreter: a fork of this
# process, with its S3 server and event-loop threads, could inherit a held lock. `setup` runs first; it may replace
# `factory`, and reads its own arguments from sys.argv[2:].
CHILD_RUN = """
import json, os, signal, sys, time
from pathlib import Path
import fsspec.asyn
import s3fs
from batchjob import cli
from batchjob.job.run import runner
from tests.fakes import FakeEngine

factory = lambda job: FakeEngine(job.model)
{setup}
cli.run_job = lambda job, progress, **kw: runner.run_job(job, progress, engine_factory=factory, **kw)
cli.main(["run", sys.argv[1], "--grace", "0"])
"""

# Kill the run with SIGKILL at the N-th S3 request of a kind that changes what the store holds: a data request (an
# object's upload completed, a copy, a delete: part uploads, _job.json, the publish's copies and deletes, the
# summary...), a lease request (its create, each renewal, its release), or the release alone; "before" the request
# is sent, or "after" its answer came back. Every write goes through s3fs's _call_s3 (an open file's commit through
# its sync wrapper).
CRASH_AT_A_REQUEST = """
kind, crash_at, when, reached = sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
VISIBLE = {"put_object", "complete_multipart_upload", "copy_object", "delete_object", "delete_objects"}
count = 0
real = s3fs.S3FileSystem._call_s3

def crash():
    open(reached, "w").close()
    os.kill(os.getpid(), signal.SIGKILL)

async def call_s3(self, method, *a, **k):
    global count
    lease = str(k.get("Key", "")).endswith("/_lock")
    release = lease and method == "delete_object"
    counted = method in VISIBLE and {"data": not lease, "lease": lease, "release": release}[kind]
    if counted:
        count += 1
        if count == crash_at and when == "before":
            crash()
    result = await real(self, method, *a, **k)
    if counted and count == crash_at and when == "after":
        crash()
    return result

s3fs.S3FileSystem._call_s3 = call_s3
s3fs.S3FileSystem.call_s3 = fsspec.asyn.sync_wrapper(call_s3)
"""


def start_child(job_file: Path, setup: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", CHILD_RUN.format(setup=setup), str(job_file), *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc: subprocess.Popen) -> tuple[int, str]:
    _, err = proc.communicate(timeout=120)
    return proc.returncode, err


def s3_job(tmp_path: Path, url: str, rows: int, **output) -> tuple[object, Path]:
    """A job of `rows` documents into `url`, and its job file for the CLI."""
    job = make_job(write_parquet(tmp_path / "docs.parquet", documents(rows)), url, output=output)
    job_file = tmp_path / f"{url.rsplit('/', 1)[-1]}.json"  # JSON is YAML: the CLI reads it as a job file
    job_file.write_text(job.model_dump_json())
    return job, job_file


def rows_once(fs, url: str) -> dict:
    got = results(fs, url)
    assert len(got) == len({r["id"] for r in got}), "a row is there twice"
    return {r["id"]: (r["output"], r["error"]) for r in got}


def lease_expires(fs, url: str) -> None:
    """Until the lease left in `url` (if any) has expired."""
    fs.invalidate_cache()
    try:
        holder = json.loads(fs.cat_file(f"{url.removeprefix('s3://')}/_lock"))
    except FileNotFoundError:
        return
    time.sleep(max(0.0, holder["expires"] - time.time()) + 0.05)


@pytest.mark.slow
def test_a_run_killed_at_any_s3_write_or_lease_write_resumes_to_every_row_once(s3, tmp_path):
    # Two parts, published as two sorted files; a short lease, so that a killed run's expires soon.
    output = {"checkpoint_rows": 3, "order": "input", "rows_per_file": 3, "lease_seconds": 0.3}
    reference = tmp_path / "reference"
    docs = write_parquet(tmp_path / "ref.parquet", documents(5))
    assert run_job(make_job(docs, reference, output=output), Messages(), engine_factory=fake_factory()) == 0
    expected = {r["id"]: (r["output"], r["error"]) for r in pq.read_table(reference / "data").to_pylist()}

    def crash_and_resume(kind: str, n: int, when: str) -> bool:
        """Kill a fresh job's run at this crash point, resume it; False if the run never got there."""
        url = f"s3://{BUCKET}/crash-{kind}-{n}-{when}"
        job, job_file = s3_job(tmp_path, url, 5, **output)
        code, err = finish(start_child(job_file, CRASH_AT_A_REQUEST, kind, str(n), when, str(tmp_path / "reached")))
        if not (tmp_path / "reached").exists():
            assert code == 0, err
            return False
        (tmp_path / "reached").unlink()
        assert code == -signal.SIGKILL, (kind, n, when, code, err)
        lease_expires(s3, url)
        assert run_job(job, Messages(), engine_factory=fake_factory()) == 0, (kind, n, when)
        assert rows_once(s3, url) == expected, (kind, n, when)
        names = [p.rsplit("/", 1)[-1] for p in s3.ls(f"{url.removeprefix('s3://')}/data", refresh=True)]
        assert names == ["sorted-000000.parquet", "sorted-000001.parquet"], (kind, n, when)
        status = OutputDir(url).status()
        assert (status["state"], status["rows_done"]) == ("done", 5), (kind, n, when, status)
        return True

    # Between one changing request and the next the store does not change: a kill before each one, and after the
    # last, meets every state the store passes through.
    n = 0
    while crash_and_resume("data", n + 1, "before"):
        n += 1
    assert n > 15  # _job.json, the parts, the timeline, the staged files, the publish, the summary, _SUCCESS...
    assert crash_and_resume("data", n, "after")
    # The lease: before and after its create, at its first renewal, before and after its release.
    for kind, k, when in [("lease", 1, "before"), ("lease", 1, "after"), ("lease", 2, "before")]:
        assert crash_and_resume(kind, k, when)
    for when in ("before", "after"):
        assert crash_and_resume("release", 1, when)


# The run's engine takes the lease from under it after its `steal_at`-th answer, as a run that took over a lease
# this one let expire (a long stall) would, records the data objects there at that moment, and waits a second:
# the run's renewal (every quarter of lease_seconds) finds the lease taken.
STEAL_THE_LEASE = """
steal_at, record = int(sys.argv[2]), sys.argv[3]

def factory(job):
    engine, fs = FakeEngine(job.model), s3fs.S3FileSystem()
    folder, stream = job.output.path.removeprefix("s3://"), engine.stream

    def stealing(requests):
        for k, output in enumerate(stream(requests), 1):
            if k == steal_at:
                other = {"pid": 1, "host": "other", "started": "2026-01-01T00:00:00+00:00", "token": "other"}
                fs.pipe_file(f"{folder}/_lock", json.dumps(other | {"expires": time.time() + 2}).encode())
                Path(record).write_text(json.dumps(sorted(fs.ls(f"{folder}/data", refresh=True))))
                time.sleep(1.0)
            yield output

    engine.stream = stealing
    return engine
"""


@pytest.mark.slow
def test_a_run_that_loses_its_lease_stops_committing_and_exits_75(s3, tmp_path):
    url = f"s3://{BUCKET}/lost"
    job, job_file = s3_job(tmp_path, url, 8, checkpoint_rows=1, lease_seconds=0.4)
    code, err = finish(start_child(job_file, STEAL_THE_LEASE, "3", str(tmp_path / "record")))
    assert code == 75, err
    assert err.strip().splitlines() == [
        f"error: {url}: another run took over this run's lease; stopping without committing"
    ]
    parts_then = json.loads((tmp_path / "record").read_text())
    assert parts_then and sorted(s3.ls(f"{BUCKET}/lost/data", refresh=True)) == parts_then  # nothing committed since
    assert json.loads(s3.cat_file(f"{BUCKET}/lost/_lock"))["token"] == "other"  # the other run's lease is left alone
    lease_expires(s3, url)
    assert run_job(job, Messages(), engine_factory=fake_factory()) == 0
    assert sorted(rows_once(s3, url)) == sorted(d["id"] for d in documents(8))


# Two runs start at once: each waits, just before its conditional create of the lease, until the other is there.
CREATE_TOGETHER = """
gate, name = Path(sys.argv[2]), sys.argv[3]
from batchjob.job.output import lease
create = lease.LeaseLock._create

def create_together(self):
    (gate / name).touch()
    end = time.monotonic() + 60
    while len(list(gate.iterdir())) < 2 and time.monotonic() < end:
        time.sleep(0.005)
    return create(self)

lease.LeaseLock._create = create_together
"""


@pytest.mark.slow
def test_two_runs_racing_for_one_lease_one_wins_the_other_exits_75(s3, tmp_path):
    url = f"s3://{BUCKET}/race"
    _, job_file = s3_job(tmp_path, url, 8, checkpoint_rows=1, lease_seconds=1.0)
    (tmp_path / "gate").mkdir()
    procs = [start_child(job_file, CREATE_TOGETHER, str(tmp_path / "gate"), name) for name in ("a", "b")]
    outcomes = sorted(finish(p) for p in procs)
    assert len(list((tmp_path / "gate").iterdir())) == 2  # both reached the create
    assert [code for code, _ in outcomes] == [0, 75], outcomes
    assert "in use by another run" in outcomes[1][1] and len(outcomes[1][1].strip().splitlines()) == 1
    assert sorted(rows_once(s3, url)) == sorted(d["id"] for d in documents(8))


# Two runs find an expired lease at once; b stalls between reading it and deleting it until a has deleted it and
# created its own (a slow network, a GC pause): b's delete then meets a's fresh lease.
TAKE_OVER_TOGETHER = """
gate, name = Path(sys.argv[2]), sys.argv[3]
from batchjob.job.output import lease
read, fs, first = lease.LeaseLock._read_raw, s3fs.S3FileSystem(), [True]

def wait_for(done):
    end = time.monotonic() + 60
    while not done() and time.monotonic() < end:
        time.sleep(0.005)

def read_then_wait(self):
    record = read(self)
    if first.pop() if first else False:  # __enter__'s read of the expired lease
        (gate / name).touch()
        if name == "a":
            wait_for(lambda: (gate / "b").exists())
        else:
            wait_for(lambda: (lease._holder((read(self) or (None,))[0]) or {}).get("token") not in (None, "dead"))
    return record

lease.LeaseLock._read_raw = read_then_wait
"""


@pytest.mark.slow
def test_two_runs_taking_over_one_expired_lease_one_wins_the_other_exits_75(s3, tmp_path):
    url = f"s3://{BUCKET}/takeover"
    _, job_file = s3_job(tmp_path, url, 8, checkpoint_rows=1, lease_seconds=1.0)
    dead = {"pid": 1, "host": "elsewhere", "started": "2026-01-01T00:00:00+00:00", "token": "dead", "expires": 0}
    s3.pipe_file(f"{BUCKET}/takeover/_lock", json.dumps(dead).encode())
    (tmp_path / "gate").mkdir()
    procs = [start_child(job_file, TAKE_OVER_TOGETHER, str(tmp_path / "gate"), name) for name in ("a", "b")]
    outcomes = sorted(finish(p) for p in procs)
    assert sorted(p.name for p in (tmp_path / "gate").iterdir()) == ["a", "b"]  # both read the expired lease
    assert [code for code, _ in outcomes] == [0, 75], outcomes
    assert sorted(rows_once(s3, url)) == sorted(d["id"] for d in documents(8))
    tags = {p.rsplit("-", 1)[-1] for p in s3.ls(f"{BUCKET}/takeover/data", refresh=True)}
    assert len(tags) == 1, f"parts of two runs: {tags}"  # the loser never held the lease, so committed nothing
    assert "in use by another run" in outcomes[1][1] and len(outcomes[1][1].strip().splitlines()) == 1


def test_rows_without_a_readable_id_get_ids_naming_the_object_with_its_scheme(s3, tmp_path, progress):
    pq.write_table(pa.table({"id": ["a", None, "c"], "text": ["x", "y", "z"]}), tmp_path / "ids.parquet")
    s3.put(str(tmp_path / "ids.parquet"), f"{BUCKET}/ids/ids.parquet")
    s3.put(
        str(write_jsonl(tmp_path / "ids.jsonl", [{"id": "d", "text": "x"}, b"{not json"])), f"{BUCKET}/ids/ids.jsonl"
    )
    failed = {}
    # Two spellings of the same objects (a glob, and s3fs's s3a:// alias) give the same ids.
    for k, (pq_path, jsonl_path) in enumerate(
        [
            (f"s3://{BUCKET}/ids/*.parquet", f"s3://{BUCKET}/ids/*.jsonl"),
            (f"s3a://{BUCKET}/ids/ids.parquet", f"s3a://{BUCKET}/ids/ids.jsonl"),
        ]
    ):
        for name, path in (("pq", pq_path), ("jsonl", jsonl_path)):
            url = f"s3://{BUCKET}/ids-out-{k}-{name}"
            assert run_job(make_job(path, url), progress, engine_factory=fake_factory()) == 0
            failed.setdefault(name, []).append(sorted(r["id"] for r in results(s3, url) if r["error"]))
    assert failed["pq"] == [[f"s3://{BUCKET}/ids/ids.parquet#1"]] * 2
    assert failed["jsonl"] == [[f"s3://{BUCKET}/ids/ids.jsonl:2"]] * 2
