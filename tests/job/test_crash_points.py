"""Kill a run at every filesystem operation of its commit path, resume, and check that every row is there once.

The run is forked (a fresh process per crash point, no interpreter start-up); in the child, each os.replace, os.fsync,
rename and unlink counts as one operation, and at the N-th the child signals itself. N goes from 1 until a run gets
through without reaching N, so every step of the commit path, `order: input`'s publish included, is a crash point.

A child forked from pytest inherits locks that other tests' threads (Ray, moto's server, polars' pool) held at that
moment, and can hang on one: a run that outlives HANG_SECONDS is killed and run again once, so that artifact of
forking a threaded test process neither hangs the suite nor passes unnoticed twice in a row."""

import os
import signal
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from batchjob.job.runner import run_job
from tests.helpers import Messages, documents, fake_factory, make_job, write_parquet

OPS = [(os, "replace"), (os, "fsync"), (Path, "rename"), (Path, "unlink")]
HANG_SECONDS = 60  # a run of 7 rows on the fake engine takes well under a second


def run_forked(job, crash_at: int | None, signum: int, tries: int = 2) -> tuple[int, bool]:
    """Run `job` in a child; returns (its exit status, whether it reached the crash point)."""
    reached = Path(job.output.path).with_name("crash-point-reached")
    reached.unlink(missing_ok=True)
    pid = os.fork()
    if pid == 0:
        count = 0
        try:
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
            code = run_job(job, Messages(), grace=0.0, engine_factory=fake_factory())
        except BaseException:
            code = 99
        os._exit(code)
    deadline = time.monotonic() + HANG_SECONDS
    while (waited := os.waitpid(pid, os.WNOHANG))[0] == 0:
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            assert tries > 1, f"a run hung twice (crash point {crash_at})"
            return run_forked(job, crash_at, signum, tries - 1)  # resumes what the hung run left
        time.sleep(0.01)
    status = waited[1]
    return (-os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)), reached.exists()


def rows_by_id(out: Path) -> dict:
    table = pq.read_table(out / "data")
    ids = table.column("id").to_pylist()
    assert len(ids) == len(set(ids)), "a row was committed twice"
    return {r["id"]: (r["output"], r["error"]) for r in table.to_pylist()}


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM])
@pytest.mark.parametrize("order", ["completion", "input"])
def test_a_run_killed_at_any_commit_step_resumes_to_the_same_rows_exactly_once(tmp_path, signum, order):
    docs = write_parquet(tmp_path / "docs.parquet", documents(7))
    output = {"checkpoint_rows": 3, "order": order, "rows_per_file": 4}
    reference = tmp_path / "reference"
    assert run_forked(make_job(docs, reference, output=output), None, signum) == (0, False)
    expected = rows_by_id(reference)
    n = 0
    while True:
        n += 1
        out = tmp_path / f"out-{n}"
        job = make_job(docs, out, output=output)
        code, crashed = run_forked(job, n, signum)
        if not crashed:
            assert code == 0
            break
        assert code in (-signum, 0, 143), (n, code)  # killed, finished, or stopped by the SIGTERM handler
        assert run_forked(job, None, signum) == (0, False), n
        assert rows_by_id(out) == expected, n
        if order == "input":
            assert all(p.name.startswith("sorted-") for p in (out / "data").iterdir()), n
    assert n > 10  # the commit path was really walked
