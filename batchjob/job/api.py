"""A job run from Python: what `batchjob run JOB_FILE` does, for a notebook, an Airflow PythonOperator or a script
that would rather not start a process. Errors a user can act on are raised (JobFileError, InputError, StateError,
LockHeld, ModelError, ...) instead of becoming exit codes; the run's own outcome is the exit code it would have."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from batchjob.job.output.state import OutputDir
from batchjob.job.run.runner import run_job
from batchjob.job.spec import JobFileError, job_from_mapping, load_job
from batchjob.job.telemetry.progress import LogProgress


@dataclass(frozen=True)
class JobResult:
    exit_code: int  # as `batchjob run`'s: 0 every row done, 3 rows failed (fail_on_row_errors), 129/130/143 stopped
    output_path: str
    summary: dict | None  # the folder's _summary.json: written once every row is done, else None

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


def run(
    job: str | Path | Mapping[str, Any],
    overrides: Sequence[str] = (),
    *,
    restart: bool = False,
    allow_numerics_change: bool = False,
    grace: float = 10.0,
    log: TextIO | None = None,
    log_interval: float = 10.0,
) -> JobResult:
    """Run a job file (a path), or a job given as the mapping its YAML would read as, to its output folder,
    resuming it as `batchjob run` does; `overrides` are --set's KEY=VALUE items (a string is one). Progress goes to
    `log` (default stderr), a line every `log_interval` seconds. Signals stop the run gracefully only when it runs in
    the main thread (only there can Python take them)."""
    if isinstance(overrides, str):  # one item, not its characters
        overrides = [overrides]
    if not isinstance(overrides, Sequence) or isinstance(overrides, bytes):
        raise JobFileError(f"overrides: expected a KEY=VALUE string or a list of them, got {overrides!r}")
    job = job_from_mapping(_plain(job), "job", overrides) if isinstance(job, Mapping) else load_job(job, overrides)
    progress = LogProgress(log or sys.stderr, interval=log_interval)
    code = run_job(job, progress, restart=restart, allow_numerics_change=allow_numerics_change, grace=grace)
    out = OutputDir(job.output.path, job.output.storage_options, job.output.lease_seconds)
    return JobResult(code, str(job.output.path), out.read_summary())


def _plain(value: Any) -> Any:
    """A job mapping as its YAML would read: a path object (pathlib's, as Python code holds paths) as its string."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return os.fspath(value) if isinstance(value, os.PathLike) else value
