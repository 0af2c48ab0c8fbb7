"""`batchjob.run_job`: `batchjob run` from Python, on the real default model, from a thread that is not the main one
(as a notebook's executor or an Airflow task would call it): a job as a mapping with --set overrides, its result and
summary, the results cache across two calls, and a bad job raised as the CLI's one-line error."""

from __future__ import annotations

import subprocess
import sys
import threading

import pyarrow.parquet as pq
import pytest

import batchjob
from batchjob.job.input.reader import InputError
from batchjob.job.output.lock import LockHeld
from batchjob.job.output.state import StateError
from batchjob.job.spec import JobFileError
from batchjob.model.errors import ModelError
from tests.helpers import write_parquet

ROWS = [{"id": f"r{i}", "text": f"Count from {i} to {i + 3}."} for i in range(6)]


def in_thread(fn, *args, **kwargs):
    """fn's result, called in a new thread (where Python installs no signal handler)."""
    result: dict = {}

    def target():
        try:
            result["value"] = fn(*args, **kwargs)
        except BaseException as e:  # handed to the test's thread
            result["error"] = e

    t = threading.Thread(target=target)
    t.start()
    t.join()
    if "error" in result:
        raise result["error"]
    return result["value"]


def job(data, tmp_path) -> dict:
    return {
        "input": {"path": str(data)},
        "sampling": {"max_tokens": 4},
        "output": {"path": str(tmp_path / "unused")},
        "cache": {"path": str(tmp_path / "cache")},
    }


def outputs(folder) -> dict[str, str]:
    return {r["id"]: r["output"] for r in pq.read_table(folder / "data").to_pylist()}


def test_run_job_from_a_thread_resumes_nothing_twice_and_takes_rows_from_the_cache(tmp_path):
    data = write_parquet(tmp_path / "a.parquet", ROWS)
    first = in_thread(batchjob.run_job, job(data, tmp_path), [f"output.path={tmp_path / 'out1'}"], log_interval=3600)
    assert first.ok and first.output_path == str(tmp_path / "out1")
    assert first.summary["cache"] == {"hits": 0, "misses": 6} and first.summary["rows_ok"] == 6
    again = in_thread(batchjob.run_job, job(data, tmp_path), [f"output.path={tmp_path / 'out1'}"])
    assert again.ok and again.summary == first.summary  # already done: nothing computed again

    edited = [dict(r, text="Name a colour.") if r["id"] == "r2" else r for r in ROWS]
    data = write_parquet(tmp_path / "b.parquet", edited)
    second = in_thread(batchjob.run_job, job(data, tmp_path), [f"output.path={tmp_path / 'out2'}"])
    assert second.ok and second.summary["cache"] == {"hits": 5, "misses": 1}
    one, two = outputs(tmp_path / "out1"), outputs(tmp_path / "out2")
    assert {k: v for k, v in two.items() if k != "r2"} == {k: v for k, v in one.items() if k != "r2"}
    assert two["r2"] != one["r2"]


def test_a_bad_job_raises_the_cli_s_one_line_error_naming_the_key(tmp_path):
    data = write_parquet(tmp_path / "a.parquet", ROWS)
    with pytest.raises(JobFileError, match=r"sampling.max_tokens: .*\[set on the command line\]"):
        batchjob.run_job(job(data, tmp_path), ["sampling.max_tokens=-1"])
    with pytest.raises(JobFileError, match=r"sampling.max_tokens: "):  # one override as a string: not its letters
        batchjob.run_job(job(data, tmp_path), "sampling.max_tokens=-1")
    with pytest.raises(JobFileError, match="engine.max_num_seqz: unknown key"):
        batchjob.run_job({**job(data, tmp_path), "engine": {"max_num_seqz": 4}})
    with pytest.raises(JobFileError, match="cannot read the job file"):
        batchjob.run_job(tmp_path / "missing.yaml")
    paths = {"input": {"path": tmp_path / "missing.parquet"}, "output": {"path": tmp_path / "unused"}}
    with pytest.raises(InputError, match="missing.parquet"):  # pathlib paths are taken as the YAML's strings
        batchjob.run_job({**paths, "cache": {"path": tmp_path / "cache"}})
    assert not (tmp_path / "unused").exists()


@pytest.mark.parametrize("overrides", [[123], [None], [b"sampling.max_tokens=4"], ["output.path=x", 4.5], None, {}])
def test_an_override_that_is_not_a_key_value_string_is_a_job_file_error(tmp_path, overrides):
    """Seen: run_job(job, [123]) raised AttributeError: 'int' object has no attribute 'partition'."""
    data = write_parquet(tmp_path / "a.parquet", ROWS)
    with pytest.raises(JobFileError, match="KEY=VALUE string") as e:
        batchjob.run_job(job(data, tmp_path), overrides)
    assert "\n" not in str(e.value) and not (tmp_path / "unused").exists()


def test_the_documented_exceptions_are_batchjob_s_own_names_and_import_no_torch():
    documented = {"JobFileError": JobFileError, "InputError": InputError, "StateError": StateError}
    documented |= {"LockHeld": LockHeld, "ModelError": ModelError}
    for name, error in documented.items():
        assert getattr(batchjob, name) is error and name in batchjob.__all__
    names = ", ".join(documented)
    code = f"import sys; from batchjob import {names}, JobResult; print('torch' in sys.modules)"
    shown = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert shown.stdout.strip() == "False"
