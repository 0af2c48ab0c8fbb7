"""Airflow: the summarize job every night, as `batchjob run` in a BashOperator (`pip install 'batchjob[airflow]'`).

Put this file (or a link to it) in Airflow's dags folder. The task runs in the repository, where the job file's
relative paths point, and needs `batchjob` on the worker's PATH. A retry resumes rather than restarts: a run skips
the rows that earlier tries committed, and once `_SUCCESS` is there for the same job it exits 0 at once. A try that
finds the output folder held by a run still going exits 75, which fails it, and a later retry takes over. Set
BATCHJOB_JOB in the worker's environment to run another job file."""

from __future__ import annotations

from datetime import datetime, timedelta
from pathlib import Path

from airflow.providers.standard.operators.bash import BashOperator
from airflow.sdk import DAG

REPO = Path(__file__).resolve().parents[1]
# The tests run this very string (batchjob/job/tests/test_airflow.py), so what they check is what Airflow runs.
BASH_COMMAND = 'batchjob run "${BATCHJOB_JOB:-jobs/summarize.yaml}"'

with DAG(
    dag_id="batchjob_summarize",
    schedule="@daily",
    start_date=datetime(2026, 1, 1),
    catchup=False,
    max_active_runs=1,
    default_args={"retries": 3, "retry_delay": timedelta(minutes=5)},
    tags=["batchjob"],
):
    BashOperator(task_id="run", bash_command=BASH_COMMAND, cwd=str(REPO))
