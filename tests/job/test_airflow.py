"""The orchestration examples in jobs/: the Airflow DAG loads in Airflow's DagBag (where Airflow, an optional extra,
is installed), and the exact command it runs is idempotent on the real model: a second run exits 0 at once on
`_SUCCESS`, and `--restart` runs the job again. The crontab example runs the same job."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

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
