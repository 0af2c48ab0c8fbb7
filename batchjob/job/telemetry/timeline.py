"""The run's engine steps over time, as `_timeline.parquet` in the output folder, for `batchjob report`.

Consecutive steps are summed into one row per `span` steps; when the rows reach MAX_ROWS, neighbours are merged in
pairs and the span doubles. So a run of any length keeps between MAX_ROWS / 2 and MAX_ROWS evenly spaced rows, and
the totals (tokens, preemptions, busy time) stay exact however coarse the rows get. A resumed run appends its rows
under the next `run` number; the file is rewritten every WRITE_INTERVAL_S and at the end of the run, so a report can
be drawn while a long job runs and a killed run loses at most that much of it."""

from __future__ import annotations

import time
from pathlib import Path

import pyarrow as pa

from batchjob.engine.outputs import StepMetrics
from batchjob.job.output.storage import read_parquet, write_table

MAX_ROWS = 2048
WRITE_INTERVAL_S = 60.0

SCHEMA = pa.schema(
    [
        ("run", pa.int32()),  # 0 for a job's first run, then one more for each resume
        ("step", pa.int64()),  # the row's first engine step
        ("steps", pa.int32()),  # engine steps summed into the row
        ("time", pa.float64()),  # unix time at the end of the row's last step
        ("busy_s", pa.float64()),  # the steps' own time (the rest of the wall time is reading, writing, planning)
        ("num_seqs", pa.float64()),  # mean sequences per step
        ("num_seqs_max", pa.int32()),
        ("prefill_tokens", pa.int64()),
        ("decode_tokens", pa.int64()),
        ("kv_cache_usage", pa.float64()),  # mean share of KV blocks in use
        ("kv_cache_usage_max", pa.float64()),
        ("preemptions", pa.int32()),
        ("prefix_cache_queries", pa.int64()),  # cumulative prompt tokens looked up in the prefix cache, this run
        ("prefix_cache_hits", pa.int64()),  # cumulative prompt tokens found there, this run
        ("num_waiting", pa.int32()),  # at the row's last step
        ("num_running", pa.int32()),
        ("token_budget", pa.float64()),  # mean step token budget (it moves under `max_num_batched_tokens: auto`)
    ]
)
_SUMS = ("steps", "busy_s", "prefill_tokens", "decode_tokens", "preemptions")
_MAXES = ("num_seqs_max", "kv_cache_usage_max")
_MEANS = ("num_seqs", "kv_cache_usage", "token_budget")  # weighted by steps
_LAST = ("time", "prefix_cache_queries", "prefix_cache_hits", "num_waiting", "num_running")


def merge(a: dict, b: dict) -> dict:
    """One row for the steps of `a` followed by those of `b`."""
    steps = a["steps"] + b["steps"]
    row = {"run": a["run"], "step": a["step"]}
    row.update({k: a[k] + b[k] for k in _SUMS})
    row.update({k: max(a[k], b[k]) for k in _MAXES})
    row.update({k: (a[k] * a["steps"] + b[k] * b["steps"]) / steps for k in _MEANS})
    row.update({k: b[k] for k in _LAST})
    return row


class Timeline:
    def __init__(self, path: Path, max_rows: int = MAX_ROWS):
        self.path, self.max_rows = path, max_rows
        self.earlier = read_timeline(path)  # the rows of the job's earlier runs
        self.run = max(self.earlier.column("run").to_pylist(), default=-1) + 1
        self.rows: list[dict] = []
        self.bucket: dict | None = None  # the row being filled, up to `span` steps
        self.span = 1
        self.last_write = time.monotonic()
        self.kv_time = self.busy = 0.0
        self.preemptions = 0

    @property
    def kv_cache_usage_mean(self) -> float | None:
        """This run's KV usage averaged over the engine's busy time; None before its first step."""
        return self.kv_time / self.busy if self.busy else None

    def add(self, m: StepMetrics) -> None:
        row = {
            "run": self.run,
            "step": m.step,
            "steps": 1,
            "time": m.time,
            "busy_s": m.step_time,
            "num_seqs": m.num_seqs,
            "num_seqs_max": m.num_seqs,
            "prefill_tokens": m.num_prefill_tokens,
            "decode_tokens": m.num_decode_tokens,
            "kv_cache_usage": m.kv_cache_usage,
            "kv_cache_usage_max": m.kv_cache_usage,
            "preemptions": m.num_preemptions,
            "prefix_cache_queries": m.prefix_cache_queries,
            "prefix_cache_hits": m.prefix_cache_hits,
            "num_waiting": m.num_waiting,
            "num_running": m.num_running,
            "token_budget": m.token_budget,
        }
        self.kv_time += m.kv_cache_usage * m.step_time
        self.busy += m.step_time
        self.preemptions += m.num_preemptions
        self.bucket = row if self.bucket is None else merge(self.bucket, row)
        if self.bucket["steps"] >= self.span:
            self.rows.append(self.bucket)
            self.bucket = None
            if len(self.rows) >= self.max_rows:
                self.rows = [
                    merge(*self.rows[i : i + 2]) if i + 1 < len(self.rows) else self.rows[i]
                    for i in range(0, len(self.rows), 2)
                ]
                self.span *= 2
        if time.monotonic() - self.last_write >= WRITE_INTERVAL_S:
            self.write()

    def table(self) -> pa.Table:
        rows = self.rows + ([self.bucket] if self.bucket else [])
        return pa.concat_tables([self.earlier, pa.Table.from_pylist(rows, schema=SCHEMA)])

    def write(self) -> None:
        write_table(self.path, self.table())
        self.last_write = time.monotonic()


def read_timeline(path: Path) -> pa.Table:
    """The timeline in `path`; empty when there is none, or when it is not one (a foreign or damaged file is
    replaced: the timeline is a report, not a record the job depends on)."""
    try:
        return read_parquet(path, schema=SCHEMA)
    except (OSError, pa.ArrowException):
        return SCHEMA.empty_table()
