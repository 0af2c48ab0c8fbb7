"""The output folder and what state it is in, read from the files themselves.

OUT/_job.json       the job's fingerprint and its row count, written before the first part
OUT/_lock           who runs on this folder now (lock.py; on an object store, a lease: lease.py)
OUT/data/*.parquet  the results: committed parts, which are also the only record of progress
OUT/_sorted/        `order: input` results being staged; `_COMPLETE` in it means ready to replace the parts
OUT/output.jsonl    OpenAI Batch output lines, when output.format is openai-batch
OUT/_timeline.parquet   the engine's steps over time (timeline.py), for `batchjob report`
OUT/metrics.prom    the last run's figures for Prometheus (prom.py)
OUT/_summary.json, OUT/_SUCCESS   written last, only when every row is done"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import pyarrow.compute as pc

from batchjob.job.lease import LeaseLock, lease_expired
from batchjob.job.lock import OutputLock, holder_alive, read_holder
from batchjob.job.storage import Location, display, is_remote, location, mtime, read_parquet, refresh, remove_tree
from batchjob.job.writer import fsync_dir, write_atomic, write_json

JOB_FILE, SUCCESS, SUMMARY, LOCK = "_job.json", "_SUCCESS", "_summary.json", "_lock"
DATA, STAGING, STAGED, OPENAI_OUTPUT = "data", "_sorted", "_COMPLETE", "output.jsonl"
TIMELINE, METRICS = "_timeline.parquet", "metrics.prom"


class StateError(Exception):
    """The folder holds something this run must not touch or continue (exit code 2)."""


@dataclass
class Committed:
    ids: set[str] = field(default_factory=set)
    rows: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0


class OutputDir:
    def __init__(self, path: str | Path, storage_options: dict | None = None, lease_seconds: float = 60.0):
        self.path: Location = location(str(path), storage_options)
        self.data, self.staging = self.path / DATA, self.path / STAGING
        self.lease_seconds = lease_seconds
        self.held: LeaseLock | None = None

    def lock(self) -> OutputLock | LeaseLock:
        if is_remote(self.path):
            self.held = LeaseLock(self.path / LOCK, self.lease_seconds)
            return self.held
        self.path.mkdir(parents=True, exist_ok=True)
        return OutputLock(self.path / LOCK)

    @property
    def run_tag(self) -> str:
        """Part-name tag of this run: its lease token on an object store, nothing locally (flock has no zombies)."""
        return self.held.token if self.held else ""

    def check_held(self) -> None:
        """Before each commit: on an object store, that this run still holds its lease."""
        if self.held:
            self.held.check()

    def recover(self) -> None:
        """Bring a folder left by a killed run to a clean state; call holding the lock."""
        self.data.mkdir(exist_ok=True)
        for folder in (self.path, self.data):
            for tmp in folder.glob(".*.tmp"):
                tmp.unlink()
        if (self.staging / STAGED).exists():
            self.publish_sorted()
        elif self.staging.exists():
            remove_tree(self.staging)

    def parts(self) -> list[Location]:
        refresh(self.data)
        return sorted(self.data.glob("*.parquet"), key=lambda p: p.name)

    def next_part_number(self) -> int:
        numbers = [int(p.stem.split("-")[1]) for p in self.data.glob("part-*.parquet")]
        return max(numbers, default=-1) + 1

    def committed(self, with_ids: bool = True) -> Committed:
        done = Committed()
        for part in self.parts():
            try:
                table = read_parquet(part, columns=["id", "error", "prompt_tokens", "output_tokens", "cached_tokens"])
            except Exception as e:  # a part is whole by construction; this is a damaged disk or a foreign file
                raise StateError(f"cannot read the committed part {part}: {e}") from None
            if with_ids:
                done.ids.update(table.column("id").to_pylist())
            done.rows += table.num_rows
            done.failed += table.num_rows - table.column("error").null_count
            for name in ("prompt_tokens", "output_tokens", "cached_tokens"):
                setattr(done, name, getattr(done, name) + (pc.sum(table.column(name)).as_py() or 0))
        return done

    def read_job(self) -> dict | None:
        try:
            return json.loads((self.path / JOB_FILE).read_text())
        except FileNotFoundError:
            return None
        except (OSError, json.JSONDecodeError) as e:
            raise StateError(f"cannot read {self.path / JOB_FILE}: {e}") from None

    def write_job(self, meta: dict) -> None:
        write_json(self.path / JOB_FILE, meta)

    def check_fingerprint(self, fingerprint: dict, *, keys: list[str]) -> None:
        """Refuse to add to results of a different job; `keys` are the fingerprint parts known so far."""
        meta = self.read_job()
        if meta is None:
            if self.parts():
                raise StateError(
                    f"{self.path} has result parts but no {JOB_FILE}, so they cannot be trusted to "
                    "belong to this job; use --restart to discard them, or another output.path"
                )
            return
        stored = meta.get("fingerprint", {})
        changed = [k for k in keys if stored.get(k) != fingerprint[k]]
        if changed:
            raise StateError(
                f"{self.path} holds results of a different job (started {meta.get('created')}): "
                f"{', '.join(changed)} changed since. Use --restart to discard them and start over, "
                "or choose another output.path"
            )

    @property
    def succeeded(self) -> bool:
        return (self.path / SUCCESS).exists()

    def reset(self) -> None:
        """Remove everything a run writes here (for --restart), and nothing else."""
        for name in (SUCCESS, SUMMARY, JOB_FILE, OPENAI_OUTPUT, TIMELINE, METRICS):
            (self.path / name).unlink(missing_ok=True)
        for folder in (self.staging, self.data):
            if folder.exists():
                remove_tree(folder)
        self.data.mkdir()
        if not is_remote(self.path):
            fsync_dir(self.path)

    def publish_sorted(self) -> None:
        """Replace the parts by the staged input-ordered files; resumable at any step after _COMPLETE exists."""
        for part in self.data.glob("part-*.parquet"):
            part.unlink()
        for staged in sorted(self.staging.glob("sorted-*.parquet"), key=lambda p: p.name):
            staged.rename(self.data / staged.name)  # on an object store a copy, then a delete: redone if cut short
        if not is_remote(self.data):
            fsync_dir(self.data)
        remove_tree(self.staging)

    def write_success(self, summary: dict) -> None:
        write_json(self.path / SUMMARY, summary)
        write_atomic(self.path / SUCCESS, lambda f: None)

    def success_time(self) -> float | None:
        """Unix time of the job's last success (when _SUCCESS was written); None if it has not succeeded."""
        try:
            return mtime(self.path / SUCCESS)
        except FileNotFoundError:
            return None

    def read_summary(self) -> dict | None:
        try:
            return json.loads((self.path / SUMMARY).read_text())
        except (OSError, json.JSONDecodeError):
            return None

    def status(self) -> dict:
        """Progress of a running or stopped job, from the folder alone."""
        meta = self.read_job()
        holder = read_holder(self.path / LOCK)
        if holder and is_remote(self.path):
            alive = not lease_expired(holder)
        else:
            alive = holder_alive(holder) if holder else False
        if self.succeeded:
            state = "done"
        elif holder and alive is not False:
            state = "running" if alive else "running elsewhere (unverified)"
        elif meta is not None:
            state = "stopped (killed; resumable)" if holder else "stopped (resumable)"
        else:
            state = "not started"
        committed = self.committed(with_ids=False) if self.data.exists() else Committed()
        parts = self.parts() if self.data.exists() else []
        return {
            "folder": display(self.path),
            "state": state,
            "holder": holder if state.startswith("running") else None,
            "rows_total": meta.get("rows_total") if meta else None,
            "rows_done": committed.rows,
            "rows_failed": committed.failed,
            "prompt_tokens": committed.prompt_tokens,
            "output_tokens": committed.output_tokens,
            "parts": len(parts),
            "last_commit_s_ago": round(time.time() - max(mtime(p) for p in parts)) if parts else None,
            "summary": self.read_summary() if self.succeeded else None,
        }


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")
