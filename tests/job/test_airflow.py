"""The orchestration examples in jobs/: the Airflow DAG file's structure, run without Airflow (every CI run) and loaded
in Airflow's DagBag (where Airflow, an optional extra, is installed); the exact command it runs is idempotent on the
real model: a second run exits 0 at once on `_SUCCESS`, and `--restart` runs the job again. The crontab example runs
the same job."""

import ast
import os
import runpy
import subprocess
import sys
import types
from datetime import datetime, timedelta
from pathlib import Path

import pytest
import yaml

from batchjob.job import exit_codes
from batchjob.job.spec import load_job
from tests.helpers import REPO, documents, write_parquet

DAG_FILE = REPO / "jobs" / "summarize_dag.py"


def dag_constant(name: str):
    """A constant of the DAG file, read without importing it: importing it needs Airflow."""
    for node in ast.parse(DAG_FILE.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise LookupError(f"{DAG_FILE} has no constant {name}")


BASH_COMMAND = dag_constant("BASH_COMMAND")


def test_the_dag_loads_in_airflow_with_retries_in_the_repository(tmp_path, monkeypatch):
    monkeypatch.setenv("AIRFLOW_HOME", str(tmp_path))  # Airflow reads its settings when first imported
    monkeypatch.setenv("AIRFLOW__CORE__LOAD_EXAMPLES", "False")
    pytest.importorskip("airflow", reason="Airflow is an optional extra: pip install -e '.[airflow]'")
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(DAG_FILE))
    assert bag.import_errors == {}
    task = bag.dags["batchjob_summarize"].get_task("run")
    assert task.bash_command == BASH_COMMAND and task.cwd == str(REPO) and task.retries == 3


def run_dag_file_without_airflow(monkeypatch) -> tuple[list[dict], list[dict]]:
    """Run the DAG file top to bottom with Airflow's two classes replaced by recorders (Airflow 3's import paths):
    the keyword arguments of each DAG, and of each task with the dag_id it was declared under."""
    dags, tasks, active = [], [], []

    class DAG:
        def __init__(self, **kwargs):
            dags.append(kwargs)

        def __enter__(self):
            active.append(dags[-1]["dag_id"])

        def __exit__(self, *exc):
            active.pop()

    class BashOperator:
        def __init__(self, **kwargs):
            tasks.append({"dag": active[-1] if active else None, **kwargs})

    names = ["airflow", "airflow.sdk", "airflow.providers", "airflow.providers.standard"]
    names += ["airflow.providers.standard.operators", "airflow.providers.standard.operators.bash"]
    for name in names:
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    sys.modules["airflow.sdk"].DAG = DAG
    sys.modules["airflow.providers.standard.operators.bash"].BashOperator = BashOperator
    runpy.run_path(str(DAG_FILE))
    return dags, tasks


def test_the_dag_file_declares_one_daily_dag_of_one_resuming_task(monkeypatch):
    dags, tasks = run_dag_file_without_airflow(monkeypatch)
    assert dags == [
        {
            "dag_id": "batchjob_summarize",
            "schedule": "@daily",
            "start_date": datetime(2026, 1, 1),
            "catchup": False,  # one run for today, not one for every day since start_date
            "max_active_runs": 1,  # two DAG runs at once would contend for the output folder (the second exits 75)
            # A failed try is retried, and the retry resumes (the command has no --restart).
            "default_args": {"retries": 3, "retry_delay": timedelta(minutes=5)},
            "tags": ["batchjob"],
        }
    ]
    # Only these arguments: in particular no skip_on_exit_code, so every nonzero exit fails the try (and is retried)
    # rather than marking it skipped.
    assert tasks == [{"dag": "batchjob_summarize", "task_id": "run", "bash_command": BASH_COMMAND, "cwd": str(REPO)}]


def test_the_dag_s_command_runs_the_summarize_job_and_its_exit_code_decides_the_try(tmp_path):
    # bash expands the command as Airflow's worker does; a `batchjob` function stands in for the CLI and shows its
    # arguments, one a line, then exits with a code chosen by the test.
    def expand(env: dict, code: int = 0) -> subprocess.CompletedProcess:
        script = f'batchjob() {{ printf "%s\\n" "$@"; return {code}; }}\n{BASH_COMMAND}'
        return subprocess.run(["bash", "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=30)

    env = {k: v for k, v in os.environ.items() if k != "BATCHJOB_JOB"}
    default = expand(env)
    assert default.returncode == 0 and default.stdout.splitlines() == ["run", "jobs/summarize.yaml"]
    assert load_job(REPO / "jobs" / "summarize.yaml").output.path  # the job file it names is there, and valid
    other = expand(env | {"BATCHJOB_JOB": str(tmp_path / "a job.yaml")})
    assert other.stdout.splitlines() == ["run", str(tmp_path / "a job.yaml")]  # one argument, spaces and all
    # The command is batchjob's exit status: nonzero fails the try. Airflow's BashOperator skips the task on 99,
    # a code batchjob never uses.
    codes = [v for k, v in vars(exit_codes).items() if k.startswith("EXIT_") and isinstance(v, int)]
    codes += list(exit_codes.EXIT_SIGNAL.values())
    assert 99 not in codes
    for code in (exit_codes.EXIT_LOCKED, exit_codes.EXIT_ROW_ERRORS, 143):
        assert expand(env, code).returncode == code


def test_the_crontab_example_runs_the_dag_s_job():
    [line] = [
        line
        for line in (REPO / "jobs" / "crontab.example").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    schedule, command = line.split()[:5], " ".join(line.split()[5:])
    assert len(schedule) == 5 and "batchjob run jobs/summarize.yaml" in command
    assert "${BATCHJOB_JOB:-jobs/summarize.yaml}" in BASH_COMMAND


@pytest.mark.slow
def test_the_dag_s_command_is_idempotent_and_restart_runs_again(tmp_path):
    out = tmp_path / "out"
    job = tmp_path / "job.yaml"
    job.write_text(
        yaml.safe_dump(
            {
                "input": {"path": str(write_parquet(tmp_path / "docs.parquet", documents(3)))},
                "sampling": {"temperature": 0.0, "max_tokens": 4},
                "engine": {"max_num_seqs": 4, "kv_cache_memory_gb": 0.05, "max_model_len": 256},
                "output": {"path": str(out)},
            }
        )
    )
    # As Airflow's worker runs it: bash, in the repository, with `batchjob` on the PATH.
    env = {
        **os.environ,
        "BATCHJOB_JOB": str(job),
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
    }

    def dag_run(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["bash", "-c", " ".join([BASH_COMMAND, *extra])],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )

    first = dag_run()
    assert first.returncode == 0, first.stdout + first.stderr
    assert "done: 3 rows ok, 0 failed" in first.stdout and (out / "_SUCCESS").exists()
    parts = {p.name: p.stat().st_mtime_ns for p in (out / "data").iterdir()}

    second = dag_run()
    assert second.returncode == 0, second.stdout + second.stderr
    assert "already complete (_SUCCESS, same job): nothing to do" in second.stdout
    assert {p.name: p.stat().st_mtime_ns for p in (out / "data").iterdir()} == parts

    again = dag_run("--restart")
    assert again.returncode == 0, again.stdout + again.stderr
    assert "--restart: discarded earlier results" in again.stdout and "done: 3 rows ok, 0 failed" in again.stdout
    assert {p.name: p.stat().st_mtime_ns for p in (out / "data").iterdir()} != parts
