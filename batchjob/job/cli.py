"""`batchjob run | plan | status`: click commands that batchjob.cli adds to its group.

`python -m batchjob.job.cli run job.yaml` runs them without the group, as the tests' subprocesses do."""
from __future__ import annotations

import json
import sys

import click

from batchjob.job.estimate import plan_job
from batchjob.job.lock import LockHeld, describe
from batchjob.job.progress import LogProgress, RichProgress
from batchjob.job.reader import InputError
from batchjob.job.runner import EXIT_LOCKED, EXIT_USAGE, run_job
from batchjob.job.spec import JobFileError, JobSpec, load_job
from batchjob.job.state import OutputDir, StateError

_set_option = click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
                           help="Override a job-file setting, e.g. --set engine.max_num_seqs=32 (repeatable).")


def _load(job_file: str, overrides: tuple[str, ...]) -> JobSpec:
    try:
        return load_job(job_file, overrides)
    except JobFileError as e:
        _fail(str(e), EXIT_USAGE)


def _fail(message: str, code: int):
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


@click.command()
@click.argument("job_file", type=click.Path(dir_okay=False))
@_set_option
@click.option("--restart", is_flag=True, help="Discard the output folder's earlier results and start over.")
@click.option("--executor", type=click.Choice(["local", "ray"]), default=None,
              help="Where the engines run: this process, or Ray workers (the job file's `ray:` section); "
                   "default: the job file's `executor`.")
@click.option("--log-format", type=click.Choice(["text", "json"]), default="text", show_default=True,
              help="Periodic log lines (used when stdout is not a terminal, and always with json).")
@click.option("--log-interval", type=float, default=10.0, show_default=True, help="Seconds between log lines.")
@click.option("--grace", type=float, default=10.0, show_default=True,
              help="On SIGINT/SIGTERM, seconds that requests in flight get to finish before they are dropped.")
def run(job_file: str, overrides: tuple[str, ...], restart: bool, executor: str | None, log_format: str,
        log_interval: float, grace: float) -> None:
    """Run JOB_FILE: read its input, generate, and commit results to its output folder; resumes by itself.

    Exit codes: 0 all rows done; 2 usage, job-file or input error; 3 finished but some rows failed (with
    fail_on_row_errors); 75 another run holds the output folder; 130/143 interrupted, resumable."""
    job = _load(job_file, overrides + ((f"executor={executor}",) if executor else ()))
    progress = (RichProgress() if sys.stdout.isatty() and log_format == "text"
                else LogProgress(interval=log_interval, json_lines=log_format == "json"))
    try:
        code = run_job(job, progress, restart=restart, grace=grace)
    except LockHeld as e:
        _fail(str(e), EXIT_LOCKED)
    except (InputError, StateError, JobFileError) as e:
        _fail(str(e), EXIT_USAGE)
    sys.exit(code)


@click.command()
@click.argument("job_file", type=click.Path(dir_okay=False))
@_set_option
@click.option("--no-calibrate", is_flag=True, help="Skip the short measured run; no time estimate.")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
def plan(job_file: str, overrides: tuple[str, ...], no_calibrate: bool, as_json: bool) -> None:
    """Show what JOB_FILE will cost without running it: tokens, prefix sharing, KV memory, time."""
    job = _load(job_file, overrides)
    try:
        report = plan_job(job, calibrate=not no_calibrate)
    except (InputError, JobFileError) as e:
        _fail(str(e), EXIT_USAGE)
    click.echo(json.dumps(report, indent=2) if as_json else _plan_text(report))


def _plan_text(r: dict) -> str:
    lines = [("rows", f"{r['rows']:,} ({r['rows_failing_before_the_model']:,} fail before the model)")]
    if r["requests"]:
        lines += [
            ("requests", f"{r['requests']:,} ({r['duplicate_rows_computed_once']:,} duplicate rows computed once)"),
            ("prompt tokens", f"total {r['prompt_tokens_total']:,} | p50 {r['prompt_tokens_p50']:,} | "
                              f"p99 {r['prompt_tokens_p99']:,}"),
            ("output tokens", f"expected {r['output_tokens_expected']:,} (at most {r['output_tokens_max']:,})"),
            ("prefix sharing", f"{100 * r['prefix_sharing_ratio']:.1f}% of prompt tokens hit cached blocks"),
            ("KV per sequence", f"mean {_mib(r['kv_bytes_per_sequence_mean'])} | "
                                f"max {_mib(r['kv_bytes_per_sequence_max'])}"),
            ("sequences that fit", f"{r['sequences_that_fit']:,} in {r['kv_cache_tokens']:,} KV tokens "
                                   f"(max_num_seqs {r['max_num_seqs']})")]
    if "calibration" in r:
        c = r["calibration"]
        lines += [("calibration", f"{c['requests']} requests: prefill {c['prefill_tokens_per_s']:,.0f} tok/s, "
                                  f"decode step {1000 * c['decode_step_s']:.1f} ms at batch {c['decode_batch_size']}"),
                  ("estimated time", f"{r['estimated_time_s']:,.0f} s")]
    return "\n".join(f"{k:<20}{v}" for k, v in lines)


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


@click.command()
@click.argument("folder", type=click.Path(exists=True, file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON.")
def status(folder: str, as_json: bool) -> None:
    """Show the progress of the job writing to FOLDER (its output.path), running or stopped."""
    try:
        s = OutputDir(folder).status()
    except StateError as e:
        _fail(str(e), EXIT_USAGE)
    if as_json:
        click.echo(json.dumps(s, indent=2))
        return
    state = s["state"] + (f" ({describe(s['holder'])})" if s["holder"] else "")
    total = s["rows_total"]
    pct = f" ({100 * s['rows_done'] / total:.1f}%)" if total else ""
    click.echo(f"{s['folder']}: {state}")
    click.echo(f"rows: {s['rows_done']:,} of {'?' if total is None else total} done{pct}, {s['rows_failed']:,} failed")
    click.echo(f"tokens: prompt {s['prompt_tokens']:,}, output {s['output_tokens']:,}")
    if s["parts"]:
        click.echo(f"parts: {s['parts']}, last commit {s['last_commit_s_ago']} s ago")
    if s["summary"]:
        click.echo(f"summary: {json.dumps(s['summary'])}")


cli = click.Group("batchjob", commands={"run": run, "plan": plan, "status": status},
                  help="Offline batch inference jobs (the job-runner commands alone).")

if __name__ == "__main__":
    cli()
