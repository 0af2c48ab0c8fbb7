"""The million-row figures: `batchjob plan`, the start of `batchjob run` (scan, plan, model load, first engine
step, then SIGTERM) and the same start when half the rows are already committed.

    python scripts/million_rows.py /tmp/million [--rows 1000000]
    python scripts/million_rows.py /tmp/million --task embed [--kill-after 120]

Each phase is one `batchjob` process; its wall time and peak RSS come from wait4. The half-done state is made by
writing the first half's results as one committed part in the output's schema (computing 500,000 rows would take the
engine days on these cores); the run then resumes from it as from any part.

With `--task embed` the same rows are embedded by the built-in all-minilm-l6-v2 from start to end: `plan`, then a
run killed with SIGKILL `--kill-after` seconds after its first commit, then the resume to the end; the script then
checks that every input id is in the output exactly once, with its embedding."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from batchjob.job.output.schema import result_schema

JOB = "input: {path: in.parquet}\nsampling: {max_tokens: 4}\nengine: {max_model_len: 128}\noutput: {path: out}\n"
EMBED_JOB = "task: embed\ninput: {path: in.parquet}\noutput: {path: out-embed}\n"
WORDS = ["apples", "rivers", "music", "winter", "cities", "robots", "gardens", "oceans", "history", "coffee"]


def generate(folder: Path, rows: int) -> None:
    """Short prompts (~39 tokens with SmolLM2's chat template), unique ids, 100,000-row row groups."""
    pl.DataFrame(
        {
            "id": [f"r{i:07d}" for i in range(rows)],
            "text": [f"Say something about {WORDS[i % 10]} {i % 9973}" for i in range(rows)],
        }
    ).write_parquet(folder / "in.parquet", row_group_size=100_000)
    (folder / "job.yaml").write_text(JOB)


def measure(folder: Path, args: list[str], until_first_step: bool = False, kill_after: float | None = None) -> dict:
    """Run `batchjob ARGS` in FOLDER; with until_first_step, send SIGTERM once the log shows an engine step; with
    kill_after, SIGKILL it that many seconds after its first committed rows."""
    command = [sys.executable, "-m", "batchjob.cli", *args]
    started = time.monotonic()
    proc = subprocess.Popen(command, cwd=folder, stdout=subprocess.PIPE, text=True)
    first_step = first_commit = None
    for line in proc.stdout:
        if until_first_step and first_step is None and '"event": "progress"' in line:
            if json.loads(line)["batch_size"] > 0:
                first_step = time.monotonic() - started
                proc.send_signal(signal.SIGTERM)
        elif kill_after is not None and first_commit is None and '"event": "progress"' in line:
            if json.loads(line)["rows_done"] > 0:
                first_commit = threading.Timer(kill_after, proc.kill)
                first_commit.start()
        elif not until_first_step:
            print(line, end="")
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return {
        "command": "batchjob " + " ".join(args),
        "exit_code": proc.returncode,
        "wall_s": round(time.monotonic() - started, 1),
        "first_step_s": first_step and round(first_step, 1),
        "cpu_s": round(usage.ru_utime + usage.ru_stime, 1),
        "peak_rss_mib": round(usage.ru_maxrss / 1024),
    }


def half_done(folder: Path, rows: int) -> None:
    """Commit the first half's rows (those an earlier run has not) as one part, as if a run had computed them."""
    data = folder / "out" / "data"
    done = pl.concat([pl.read_parquet(p, columns=["id"]) for p in data.glob("part-*.parquet")] or [pl.DataFrame()])
    first = pl.read_parquet(folder / "in.parquet", columns=["id"]).head(rows // 2).with_row_index("row_index")
    if "id" in done.columns:
        first = first.filter(~pl.col("id").is_in(done["id"].implode()))
    n = first.height
    columns = {
        "id": first["id"].to_arrow(),
        "output": pa.array(["Sure."] * n),
        "finish_reason": pa.array(["stop"] * n),
        "prompt_tokens": pa.array([39] * n, pa.int32()),
        "output_tokens": pa.array([2] * n, pa.int32()),
        "cached_tokens": pa.array([0] * n, pa.int32()),
        "truncated": pa.array([False] * n),
        "row_index": first["row_index"].cast(pl.Int64).to_arrow(),
    }
    schema = result_schema(pa.schema([]))
    table = pa.table({f.name: columns.get(f.name, pa.nulls(n, f.type)) for f in schema}, schema=schema)
    pq.write_table(table, data / "part-000900.parquet")


def embed_phases(folder: Path, rows: int, kill_after: float) -> list[dict]:
    """plan, a run killed with -9 mid-way, its resume to the end; then every input id in the output once."""
    (folder / "embed.yaml").write_text(EMBED_JOB)
    run = ["run", "embed.yaml", "--log-format", "json", "--log-interval", "1"]
    results = [measure(folder, ["plan", "embed.yaml"])]
    results.append(measure(folder, [*run, "--restart"], kill_after=kill_after))
    results[-1]["command"] += f"  (SIGKILL {kill_after:g} s after its first commit)"
    results.append(measure(folder, run))
    results[-1]["command"] += "  (resume to the end)"
    out = pl.scan_parquet(folder / "out-embed" / "data" / "*.parquet")
    summary = out.select(
        pl.len().alias("rows"),
        pl.col("id").n_unique().alias("distinct_ids"),
        pl.col("embedding").is_null().sum().alias("without_embedding"),
    ).collect()
    results.append(summary.to_dicts()[0] | {"input_rows": rows})
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("folder", type=Path)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--task", choices=["generate", "embed"], default="generate")
    parser.add_argument("--kill-after", type=float, default=120.0, help="--task embed: seconds after the first commit")
    a = parser.parse_args()
    a.folder.mkdir(parents=True, exist_ok=True)
    if not (a.folder / "in.parquet").exists() or pq.read_metadata(a.folder / "in.parquet").num_rows != a.rows:
        generate(a.folder, a.rows)
    print("load average", os.getloadavg(), f"on {os.cpu_count()} cores")
    if a.task == "embed":
        for r in embed_phases(a.folder, a.rows, a.kill_after):
            print(json.dumps(r))
        print("load average", os.getloadavg())
        return
    results = [measure(a.folder, ["plan", "job.yaml"])]
    run = ["run", "job.yaml", "--restart", "--log-format", "json", "--log-interval", "0"]
    results.append(measure(a.folder, run, until_first_step=True))
    half_done(a.folder, a.rows)
    results.append(measure(a.folder, run[:2] + run[3:], until_first_step=True))
    results[-1]["command"] += "  (resume: half the rows committed)"
    for r in results:
        print(json.dumps(r))
    print("load average", os.getloadavg())


if __name__ == "__main__":
    main()
