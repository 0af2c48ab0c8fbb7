"""The output folder and what state it is in, read from the files themselves.

OUT/_job.json       the job's fingerprint and its row count, written before the first part
OUT/_lock           who runs on this folder now (lock.py; on an object store, a lease: lease.py)
OUT/data/*.parquet  the results: committed parts, which are also the only record of progress
OUT/_sorted/        `order: input` results being staged; `_COMPLETE` in it lists them and means ready to publish
OUT/_quarantine/    parts found damaged (e.g. truncated by a full disk), moved aside; their rows are redone
OUT/output.jsonl    OpenAI Batch output lines, when output.format is openai-batch
OUT/_timeline.parquet   the engine's steps over time (timeline.py), for `batchjob report`
OUT/metrics.prom    the last run's figures for Prometheus (prom.py)
OUT/_summary.json, OUT/_SUCCESS   written last, only when every row is done

Beside data/, batchjob overwrites or deletes only the files that _job.json's "files" names: a name is recorded there
before batchjob first writes it, so a folder's own files of those names (the user's metrics.prom, say) are refused,
never touched."""

from __future__ import annotations

import contextlib
import itertools
import json
import re
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from batchjob.job.output.lease import LeaseLock, LeaseUnsupported, lease_expired
from batchjob.job.output.lock import OutputLock, lock_is_held, read_holder
from batchjob.job.output.lora_counts import LORA_METADATA, LoraCounts
from batchjob.job.output.schema import CACHE_METADATA
from batchjob.job.output.storage import (
    TMP_PREFIX,
    Location,
    display,
    fsync_dir,
    is_remote,
    location,
    mtime,
    parquet_file,
    refresh,
    write_atomic,
    write_json,
)

JOB_FILE, SUCCESS, SUMMARY, LOCK = "_job.json", "_SUCCESS", "_summary.json", "_lock"
DATA, STAGING, STAGED, OPENAI_OUTPUT = "data", "_sorted", "_COMPLETE", "output.jsonl"
TIMELINE, METRICS, QUARANTINE = "_timeline.parquet", "metrics.prom", "_quarantine"
COUNTED_COLUMNS = ("id", "error", "prompt_tokens", "output_tokens", "cached_tokens")  # of the committed parts
# What the fingerprint parts that an earlier batchjob did not record stood for then.
FINGERPRINT_DEFAULTS = {
    "task": "generate",
    # Before row data was text, special-token strings in it were read as special tokens.
    "prompt": {"chat_template_kwargs": {}, "special_tokens_in_data": True},
    "output": {"split_reasoning": False},
    "lora": None,  # LoRA adapters' digests by name: none before there were adapters, and in a job without them
}
# The files batchjob writes beside data/ (recorded in _job.json's "files" before it first writes them).
WRITTEN = (SUCCESS, SUMMARY, OPENAI_OUTPUT, TIMELINE, METRICS)
# The files that say the job is complete: removed together, first, whenever the results are repaired.
COMPLETION = (SUCCESS, SUMMARY, OPENAI_OUTPUT)
# The only names batchjob writes inside data/, _sorted/ and _quarantine/; cleanup deletes these and nothing else.
OUR_FILE = re.compile(rf"(part|sorted)-\d{{6}}(-[0-9a-f]+)?\.parquet|{re.escape(TMP_PREFIX)}.*\.tmp|{STAGED}")


class StateError(Exception):
    """The folder holds something this run must not touch or continue (exit code 2)."""


@dataclass
class Committed:
    ids: pa.ChunkedArray = field(default_factory=lambda: pa.chunked_array([], pa.string()))
    rows: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    cache_hits: int = 0  # rows the results cache gave
    cache_misses: int = 0  # rows looked up there in vain, then computed
    # with engine.lora: the rows by adapter that the parts record (LORA_METADATA), and the rows of parts recording
    # none (written before parts did, or an `order: input` job's sorted files)
    lora: LoraCounts = field(default_factory=LoraCounts)
    lora_unrecorded: int = 0

    def done_at(self, ids: pa.ChunkedArray) -> np.ndarray:
        """For each of the input's ids (by position), whether it is committed: one hash lookup in Arrow, a byte a
        row, where a set of the ids would take a Python string each. Not polars: its thread pool deadlocks in a
        process forked after it ran (Airflow's task runner forks, so does the crash-point test)."""
        return pc.is_in(ids, value_set=self.ids.combine_chunks()).to_numpy(zero_copy_only=False)


def _cache_counts(text: bytes) -> tuple[int, int]:
    """A part's CACHE_METADATA, read back (so untrusted): its hits and misses; ValueError where they are not counts."""
    cache = json.loads(text)
    counts = (cache.get("hits", 0), cache.get("misses", 0)) if isinstance(cache, dict) else None
    if counts is None or not all(type(n) is int and n >= 0 for n in counts):
        raise ValueError(f"its results-cache counts are not counts: {text[:80]!r}")
    return counts


class OutputDir:
    def __init__(self, path: str | Path, storage_options: dict | None = None, lease_seconds: float = 60.0):
        self.path: Location = location(str(path), storage_options)
        self.data, self.staging = self.path / DATA, self.path / STAGING
        self.lease_seconds = lease_seconds
        self.held: LeaseLock | None = None
        self.created: list[Path] = []  # the local folders lock() made: the output folder, then parents it lacked

    def lock(self) -> OutputLock | LeaseLock:
        if is_remote(self.path):
            try:
                self.held = LeaseLock(self.path / LOCK, self.lease_seconds)
            except LeaseUnsupported as e:
                raise StateError(str(e)) from None
            return self.held
        if self.path.exists() and not self.path.is_dir():
            raise StateError(f"output.path: {self.path} is a file; give it a folder (batchjob writes parts into it)")
        self.created = list(itertools.takewhile(lambda p: not p.exists(), [self.path, *self.path.parents]))
        self.path.mkdir(parents=True, exist_ok=True)
        lock = self.path / LOCK
        if lock.is_symlink() or (lock.exists() and not lock.is_file()):  # OutputLock refuses these too, less clearly
            raise StateError(f"{lock} is not a regular file (a symlink?); batchjob will not open it")
        # batchjob's lock file is empty or names its holder; taking the lock would empty anything else
        if lock.exists() and lock.stat().st_size and read_holder(lock) is None:
            raise StateError(f"{lock} is not batchjob's lock file; move it away or choose another output.path")
        return OutputLock(lock)

    def discard_unused(self, lock: OutputLock | LeaseLock) -> None:
        """Delete the folder lock() made (and the parents it made for it) when this run left nothing in it but its
        lock and an empty data/ (a run that failed before its first record, at a model that does not load, say).
        Called holding the lock: a run that opened the lock file meanwhile finds it gone once it locks it
        (OutputLock), and does not run."""
        if not (self.created and isinstance(lock, OutputLock)):
            return
        # OSError: a cleanup that fails must not hide why the run ended; a run may have made its lock there since
        with contextlib.suppress(OSError):
            entries = {p.name: p for p in self.path.iterdir()}
            data = entries.get(DATA)
            if set(entries) - {LOCK, DATA} or (data and (data.is_symlink() or any(data.iterdir()))):
                return
            if data:
                data.rmdir()
            lock.discard()
            for folder in self.created:
                folder.rmdir()

    @property
    def run_tag(self) -> str:
        """Part-name tag of this run: its lease token on an object store, nothing locally (flock has no zombies)."""
        return self.held.token if self.held else ""

    def check_held(self) -> None:
        """Before each commit: on an object store, that this run still holds its lease."""
        if self.held:
            self.held.check()

    def recover(self) -> list[Path]:
        """Bring a folder left by a killed run to a clean state; call holding the lock. Returns the damaged parts
        moved to _quarantine/ (their rows are not committed any more, so this run redoes them; the job is no longer
        complete)."""
        for folder in (self.data, self.staging, self.path / QUARANTINE):
            if not is_remote(folder) and folder.exists() and not folder.is_dir():
                raise StateError(f"{folder} is not a folder; batchjob keeps its files there: move it away")
        self.data.mkdir(exist_ok=True)
        for folder in (self.path, self.data):
            for tmp in folder.glob(f"{TMP_PREFIX}*.tmp"):
                tmp.unlink()
        if (self.staging / STAGED).exists():
            self.publish_sorted()
        elif self.staging.exists():
            remove_ours(self.staging)
        return self.quarantine_damaged()

    def quarantine_damaged(self) -> list[Path]:
        """Move aside every part whose Parquet footer cannot be read: a part is whole by construction, so this is a
        disk that lost a write (or was full); its rows will be redone."""
        moved = []
        for part in self.parts():
            if _footer_rows(part) is None:
                if not moved:  # before the first part goes, so no crash leaves _SUCCESS beside missing rows
                    self.invalidate()
                target = self.path / QUARANTINE / f"{part.stem}-{int(time.time())}{part.suffix}"
                target.parent.mkdir(exist_ok=True)
                part.rename(target)
                moved.append(target)
        if moved and not is_remote(self.data):
            fsync_dir(self.data)
        return moved

    def invalidate(self) -> None:
        """The results are no longer complete (a part was moved aside or is missing): remove the files that say they
        are, _SUCCESS first, so that the next run redoes the missing rows instead of finding the job done."""
        recorded = self.recorded(self.read_job())
        for name in COMPLETION:
            if name in recorded:
                (self.path / name).unlink(missing_ok=True)
        if not is_remote(self.path):
            fsync_dir(self.path)

    def complete(self, meta: dict | None) -> bool:
        """Whether the folder holds a finished job: _SUCCESS, the _job.json that explains it, and every row it
        counts in the parts (a part deleted after the job finished leaves _SUCCESS standing over missing rows)."""
        if meta is None or not self.succeeded:
            return False
        total = meta.get("rows_total")  # None: a record without the count, which cannot be checked
        return total is None or sum(_footer_rows(p) or 0 for p in self.parts()) == total

    @staticmethod
    def recorded(meta: dict | None) -> set[str]:
        """The files beside data/ that batchjob's records say it wrote: _job.json's "files" (every one of WRITTEN
        for a _job.json from before that list, as that batchjob wrote them all); none without a _job.json."""
        if meta is None:
            return set()
        return set(meta.get("files", WRITTEN))

    def own(self, name: str) -> bool:
        """Record in _job.json that batchjob writes `name` beside data/, before it does. False where no job is
        recorded yet: then nothing may be written there."""
        meta = self.read_job()
        if meta is None:
            return False
        if name not in self.recorded(meta):
            self.write_job({**meta, "files": sorted({*meta.get("files", []), name})})
        return True

    def unrecorded_files(self, meta: dict | None) -> list[Location]:
        """Files beside data/ with a name batchjob writes that its records do not name: someone else's, which batchjob
        must neither overwrite nor delete. An empty _SUCCESS is a marker that holds nothing, not a file to keep."""
        recorded = self.recorded(meta)
        found = []
        for name in WRITTEN:
            path = self.path / name
            if name in recorded or not path.exists():
                continue
            if name == SUCCESS and path.is_file() and path.stat().st_size == 0:
                continue
            found.append(path)
        return found

    def parts(self) -> list[Path]:
        refresh(self.data)
        return sorted((p for p in self.data.glob("*.parquet") if OUR_FILE.fullmatch(p.name)), key=lambda p: p.name)

    def foreign_files(self) -> list[Path]:
        """Files in data/ or _sorted/ that batchjob did not write: refuse to run on, or delete, such a folder."""
        return sorted(
            p for d in (self.data, self.staging) if d.is_dir() for p in d.iterdir() if not OUR_FILE.fullmatch(p.name)
        )

    def next_part_number(self) -> int:
        numbers = [int(p.stem.split("-")[1]) for p in self.data.glob("part-*.parquet")]
        return max(numbers, default=-1) + 1

    def committed(self, with_ids: bool = True) -> Committed:
        return self._count(self.parts(), with_ids)

    def _count(self, parts: list[Path], with_ids: bool = False) -> Committed:
        done, id_chunks = Committed(), []
        for part in parts:
            try:
                with parquet_file(part) as pf:  # an embedding job's parts have no output or cached tokens
                    table = pf.read(columns=[c for c in COUNTED_COLUMNS if c in pf.schema_arrow.names])
                    metadata = pf.schema_arrow.metadata or {}
                    hits, misses = _cache_counts(metadata.get(CACHE_METADATA, b"{}"))
                    lora = LoraCounts.from_metadata(metadata[LORA_METADATA]) if LORA_METADATA in metadata else None
            except Exception as e:  # a part is whole by construction; this is a damaged disk or a foreign file
                raise StateError(f"cannot read the committed part {part}: {e}") from None
            if with_ids:
                id_chunks.append(table.column("id"))
            done.rows += table.num_rows
            done.failed += table.num_rows - table.column("error").null_count
            done.cache_hits += hits
            done.cache_misses += misses
            if lora is None:
                done.lora_unrecorded += table.num_rows
            else:
                done.lora.merge(lora)
            for name in ("prompt_tokens", "output_tokens", "cached_tokens"):
                if name in table.column_names:
                    setattr(done, name, getattr(done, name) + (pc.sum(table.column(name)).as_py() or 0))
        if id_chunks:
            done.ids = pa.chunked_array([c for column in id_chunks for c in column.chunks], pa.string())
        return done

    def read_job(self) -> dict | None:
        """_job.json, which batchjob writes whole (never half): anything else in its place is not batchjob's record,
        so it is refused, and nothing here is cleaned up on its word."""
        path = self.path / JOB_FILE
        try:
            meta = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:  # ValueError: not JSON, or not UTF-8
            raise StateError(f"cannot read {path}: {e}; move it away or choose another output.path") from None
        shapes = {"fingerprint": dict, "files": list, "rows_total": int}
        if not isinstance(meta, dict) or any(k in meta and not isinstance(meta[k], t) for k, t in shapes.items()):
            raise StateError(f"{path} is not a job record batchjob wrote; move it away or choose another output.path")
        return meta

    def write_job(self, meta: dict) -> None:
        write_json(self.path / JOB_FILE, meta)

    def check_fingerprint(self, fingerprint: dict, *, keys: list[str]) -> None:
        """Refuse to add to results of a different job, or to write over files that are not batchjob's; `keys` are
        the fingerprint parts known so far."""
        meta = self.read_job()
        if foreign := self.foreign_files():
            raise StateError(
                f"{self.path} holds files batchjob did not write ({', '.join(p.name for p in foreign[:3])}"
                f"{', ...' if len(foreign) > 3 else ''} in {foreign[0].parent.name}/); choose another output.path"
            )
        if unrecorded := self.unrecorded_files(meta):
            raise StateError(self._unrecorded(unrecorded, "nothing was written"))
        if meta is None:
            if self.parts():
                raise StateError(
                    f"{self.path} has result parts but no {JOB_FILE}, so nothing says which job they belong to; "
                    "batchjob will not delete them: move them away or choose another output.path"
                )
            return
        # A fingerprint part that an earlier batchjob did not record had the one value it then could have.
        stored = _with_defaults(meta.get("fingerprint", {}), FINGERPRINT_DEFAULTS)
        fingerprint = _with_defaults(fingerprint, FINGERPRINT_DEFAULTS)
        changed = [k for k in keys if stored.get(k) != fingerprint[k]]
        if changed:
            settings = ", ".join(s for k in changed for s in _changed_settings(k, stored.get(k), fingerprint[k]))
            raise StateError(
                f"{self.path} holds results of a different job (started {meta.get('created')}): "
                f"{', '.join(changed)} changed since{f' ({settings})' if settings else ''}. "
                "Use --restart to discard them and start over, or choose another output.path"
            )

    @property
    def succeeded(self) -> bool:
        return (self.path / SUCCESS).exists()

    def reset(self) -> None:
        """Remove what a run wrote here (for --restart), and nothing else. Refused unless _job.json says that batchjob
        made this folder's results, and if data/ holds anything batchjob does not write."""
        if self.read_job() is None and self.parts():
            raise StateError(
                f"--restart: {self.path} has result parts but no {JOB_FILE}, so batchjob did not record them and "
                "will not delete them; move them away or choose another output.path"
            )
        if foreign := self.foreign_files():
            raise StateError(
                f"--restart: {self.path} holds files batchjob did not write ({', '.join(p.name for p in foreign[:3])}"
                f"{', ...' if len(foreign) > 3 else ''}); nothing was deleted. Move them away or choose another "
                "output.path"
            )
        meta = self.read_job()
        if unrecorded := self.unrecorded_files(meta):
            raise StateError("--restart: " + self._unrecorded(unrecorded, "nothing was deleted"))
        # _job.json last: until it is gone, a crash in the middle leaves a folder that --restart may still clear.
        recorded = self.recorded(meta)
        for name in WRITTEN:
            if name in recorded:
                (self.path / name).unlink(missing_ok=True)
        for folder in (self.staging, self.data, self.path / QUARANTINE):
            remove_ours(folder)
        (self.path / JOB_FILE).unlink(missing_ok=True)
        self.data.mkdir(exist_ok=True)
        if not is_remote(self.path):
            fsync_dir(self.path)

    def _unrecorded(self, files: list[Location], outcome: str) -> str:
        names = ", ".join(p.name for p in files)
        return (
            f"{self.path} holds {names}, which batchjob's records ({JOB_FILE}) do not name as its own; {outcome}. "
            "Move them away or choose another output.path"
        )

    def stage_complete(self) -> None:
        """Mark the staged input-ordered files ready to publish; _COMPLETE lists them, so a publish interrupted at any
        step finishes the same way and knows which sorted-* files in data/ are stale (another rows_per_file)."""
        names = sorted(p.name for p in self.staging.glob("sorted-*.parquet"))
        write_json(self.staging / STAGED, names)

    def publish_sorted(self) -> None:
        """Replace the parts (and any earlier sorted-* files) by the staged ones; resumable at any step."""
        try:
            names = set(json.loads((self.staging / STAGED).read_text()) or [])
        except json.JSONDecodeError:  # an empty _COMPLETE from an older version: it staged every sorted-* file
            names = {p.name for p in self.staging.glob("sorted-*.parquet")}
        for old in self.data.glob("*.parquet"):
            if OUR_FILE.fullmatch(old.name) and not (old.name in names and not (self.staging / old.name).exists()):
                old.unlink()
        for staged in sorted(self.staging.glob("sorted-*.parquet"), key=lambda p: p.name):
            staged.rename(self.data / staged.name)  # on an object store a copy, then a delete: redone if cut short
        if not is_remote(self.data):
            fsync_dir(self.data)
        remove_ours(self.staging)

    def write_success(self, summary: dict) -> None:
        self.own(SUMMARY)
        self.own(SUCCESS)
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
        # A live lease on an object store; locally the flock, not the recorded pid (which may belong to another).
        held = bool(holder) and not lease_expired(holder) if is_remote(self.path) else lock_is_held(self.path / LOCK)
        parts = self.parts() if self.data.exists() else []
        damaged = [p for p in parts if _footer_rows(p) is None]
        parts = [p for p in parts if p not in damaged]
        committed = self._count(parts)
        total = meta.get("rows_total") if meta else None
        if held:
            state = "running"
        elif self.succeeded and meta is not None and total in (None, committed.rows):
            state = "done"
        elif self.succeeded and meta is not None:  # a part went missing after the job finished
            state = f"incomplete ({total - committed.rows} rows missing; the next run redoes them)"
        elif meta is not None:
            state = "stopped (killed; resumable)" if holder else "stopped (resumable)"
        else:
            state = "not started"
        if damaged:
            state += f"; {len(damaged)} damaged part(s), moved aside and redone by the next run"
        summary = self.read_summary() if state == "done" else None
        # `order: input`'s sorted files do not carry the parts' cache counts: a finished job's are in its summary
        cache = (summary or {}).get("cache", {"hits": committed.cache_hits, "misses": committed.cache_misses})
        lora, unrecorded = None, 0
        if ((meta or {}).get("job") or {}).get("engine", {}).get("lora"):  # rows by adapter, as the summary's
            if summary and "lora" in summary:  # a finished job's: its sorted files (order: input) record none
                lora = summary["lora"]
            else:
                lora, unrecorded = committed.lora.counts(), committed.lora_unrecorded
        return {
            "folder": display(self.path),
            "state": state,
            "holder": holder if held else None,
            "rows_total": total,
            "rows_done": committed.rows,
            "rows_failed": committed.failed,
            "prompt_tokens": committed.prompt_tokens,
            "output_tokens": committed.output_tokens,
            "cache_hits": cache["hits"],
            "cache_misses": cache["misses"],
            "parts": len(parts),
            "last_commit_s_ago": round(time.time() - max(mtime(p) for p in parts)) if parts else None,
            "summary": summary,
            "lora": lora,
            "lora_unrecorded_rows": unrecorded,
        }


def remove_ours(folder: Location) -> None:
    """Delete the files batchjob writes in `folder`, then the folder if that left it empty."""
    if not folder.is_dir():
        return
    for p in folder.iterdir():
        if OUR_FILE.fullmatch(p.name) and p.is_file():
            p.unlink()
    # An object store has no empty folders to remove; a symlinked folder (data/ on another disk) stays linked.
    if not is_remote(folder) and not folder.is_symlink() and not any(folder.iterdir()):
        folder.rmdir()


def _footer_rows(part: Location) -> int | None:
    """The rows a part's footer counts; None where the footer cannot be read."""
    try:
        return parquet_file(part).metadata.num_rows
    except Exception:  # any unreadable footer, whatever pyarrow calls it
        return None


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _changed_settings(key: str, stored, now) -> list[str]:
    """The settings of a changed fingerprint section that changed (prompt.special_tokens_in_data, say)."""
    if not (isinstance(stored, dict) and isinstance(now, dict)):
        return []
    return [f"{key}.{k}" for k in sorted(stored.keys() | now.keys()) if stored.get(k) != now.get(k)]


def _with_defaults(stored: dict, defaults: dict) -> dict:
    """`stored` with each part it lacks taken from `defaults`, section by section."""
    out = dict(stored)
    for key, value in defaults.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict) and value:
            out[key] = _with_defaults(out[key], value)
        else:
            out.setdefault(key, value)
    return out
