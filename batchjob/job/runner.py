"""One run of a job: check, resume, stream rows through the engine into parts, finish the folder.

Exit codes (README): 0 all rows done; 2 usage, job-file or input error; 3 finished but some rows failed (with
fail_on_row_errors); 75 another run holds the output folder; 130 / 143 interrupted by SIGINT / SIGTERM, resumable."""

from __future__ import annotations

import contextlib
import hashlib
import json
import signal
import time
from collections.abc import Callable, Iterable, Iterator

from batchjob.engine.outputs import RequestOutput, StepMetrics
from batchjob.job.lock import describe
from batchjob.job.planner import Planner, Work
from batchjob.job.progress import Progress
from batchjob.job.prom import write_metrics
from batchjob.job.prompt import PromptBuilder
from batchjob.job.reader import InputSource, Row, Scan
from batchjob.job.spec import JobSpec
from batchjob.job.state import METRICS, OPENAI_OUTPUT, STAGED, TIMELINE, Committed, OutputDir, now_iso
from batchjob.job.timeline import Timeline
from batchjob.job.writer import PartWriter, failed_row, result_rows, sort_parts, write_atomic, write_openai_output

EXIT_OK, EXIT_USAGE, EXIT_ROW_ERRORS, EXIT_LOCKED = 0, 2, 3, 75
EXIT_SIGNAL = {signal.SIGINT: 130, signal.SIGTERM: 143}
MODEL_KEYS = ("model_digest", "model_revision")  # the fingerprint's parts known only once the model is loaded
# Truncation (max_model_len), output lengths (elastic_*), sampling draws (seed) and numbers by design (dtypes).
RESULT_ENGINE_SETTINGS = {
    "max_model_len",
    "elastic_compression",
    "elastic_max_tokens_floor",
    "seed",
    "dtype",
    "kv_cache_dtype",
}


def load_engine(job: JobSpec):
    from batchjob.engine.engine import Engine  # here, not at import: torch and the weights are slow to load

    return Engine(job.model, **job.engine.model_dump(exclude_unset=True))


def fingerprint(job: JobSpec, source: InputSource, model_digest: str | None) -> dict:
    """What makes two runs' results belong to one dataset. Engine tuning (batch sizes, memory, preemption) may change
    between runs; the engine settings that change what is computed may not."""
    fp = {
        "model": job.model,
        "model_digest": model_digest,
        "model_revision": None,  # the Hub commit, known with the digest
        "prompt": job.prompt.model_dump(),
        "sampling": job.sampling.model_dump(),
        "engine": job.engine.model_dump(include=RESULT_ENGINE_SETTINGS),
        "input": {
            **job.input.model_dump(include={"format", "id_column", "text_column", "messages_column", "passthrough"}),
            "files": source.identity(),
        },
    }
    return json.loads(json.dumps(fp))  # as it reads back from _job.json, for comparing


class Interrupted(Exception):
    """A signal came during Stopper.interruptible()."""


class Stopper:
    """SIGINT/SIGTERM: stop admitting work; requests in flight get `grace` seconds to finish, and the end of the grace
    or a second signal drops the rest (uncommitted, so they run again on resume)."""

    def __init__(self, grace: float):
        self.grace = grace
        self.signum: int | None = None
        self.count = 0
        self.since = 0.0
        self.interrupt = False

    def __enter__(self) -> Stopper:
        self._previous = {s: signal.signal(s, self._handle) for s in EXIT_SIGNAL}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def _handle(self, signum: int, frame) -> None:
        if self.signum is None:
            self.signum, self.since = signum, time.monotonic()
        self.count += 1
        if self.interrupt:
            raise Interrupted(signum)

    @contextlib.contextmanager
    def interruptible(self) -> Iterator[None]:
        """Within it a signal also raises Interrupted, to leave a blocking wait that cannot look at the flag."""
        if self.signum is not None:
            raise Interrupted(self.signum)
        self.interrupt = True
        try:
            yield
        finally:
            self.interrupt = False

    @property
    def drop_in_flight(self) -> bool:
        return self.count > 1 or (self.signum is not None and time.monotonic() - self.since >= self.grace)


def run_job(
    job: JobSpec,
    progress: Progress,
    *,
    restart: bool = False,
    grace: float = 10.0,
    engine_factory: Callable[[JobSpec], object] = load_engine,
) -> int:
    """The exit code of a run that got going; LockHeld, InputError, StateError and JobFileError when it cannot."""
    run_class = JobRun
    if job.executor == "ray":
        from batchjob.job.ray_executor import RayJobRun  # Ray is an optional extra, imported only when asked for

        run_class = RayJobRun
    out = OutputDir(job.output.path)
    with out.lock() as lock, Stopper(grace) as stopper:
        if lock.stale and lock.stale.get("pid"):
            progress.message(f"took over the lock of a run that is gone ({describe(lock.stale)})")
        return run_class(job, out, progress, stopper, engine_factory).run(restart)


class JobRun:
    def __init__(self, job: JobSpec, out: OutputDir, progress: Progress, stopper: Stopper, engine_factory):
        self.job, self.out, self.progress, self.stopper = job, out, progress, stopper
        self.engine_factory = engine_factory
        self.in_flight: dict[str, Work] = {}
        self.stop_committed = False
        self.aborted = False
        self.engine = None  # a local run's, once loaded
        self.timeline: Timeline | None = None  # the local engine's steps; engines on Ray workers report none

    def run(self, restart: bool) -> int:
        job, out = self.job, self.out
        started = time.monotonic()
        out.recover()
        source = InputSource(job)
        fp = fingerprint(job, source, None)
        if restart:
            self.progress.message(f"--restart: discarding earlier results in {out.path}")
            out.reset()
        # Everything but the model digest is known before the slow model load, so a mismatch fails at once.
        out.check_fingerprint(fp, keys=[k for k in fp if k not in MODEL_KEYS])
        if out.succeeded:
            return self._already_done()
        scan = source.scan()
        committed = out.committed()
        if committed.rows < scan.total and self.stopper.signum is None:
            if committed.rows:
                self.progress.message(f"resuming: {committed.rows} of {scan.total} rows already done")
            self._generate(source, scan, committed, fp)
        result = out.committed(with_ids=False)
        if result.rows < scan.total and self.stopper.signum is not None:
            self.progress.message(f"interrupted: {result.rows} of {scan.total} rows committed; run again to resume")
            return self._write_metrics(result, scan.total, EXIT_SIGNAL[self.stopper.signum])
        return self._finish(result, scan.total, time.monotonic() - started)

    def _generate(self, source: InputSource, scan: Scan, committed: Committed, fp: dict) -> None:
        job, out = self.job, self.out
        self.engine = self.engine_factory(job)
        self._check_model(fp, self.engine.model_digest, self.engine.model_revision)
        builder = PromptBuilder(job, self.engine.tokenizer, self.engine.max_model_len)
        builder.check()
        self._write_job(fp, scan)
        if self.stopper.signum is not None:  # stopped during the model load: nothing started, nothing to commit
            return
        self.writer = PartWriter(
            out.data,
            scan.passthrough_schema,
            checkpoint_rows=job.output.checkpoint_rows,
            checkpoint_seconds=job.output.checkpoint_seconds,
            next_part=out.next_part_number(),
        )
        planner = Planner(
            builder,
            job.sampling,
            sort_window=job.schedule.sort_window,
            dedupe=job.schedule.dedupe,
            block_size=self.engine.config.block_size,
            on_error=self._row_failed,
        )
        rows = (row for row in source.rows() if row.id not in committed.ids)
        self.progress.start(scan.total, committed.rows)
        self.timeline = Timeline(out.path / TIMELINE)
        self.engine.add_step_callback(self._on_step)
        try:
            for output in self.engine.stream(self._requests(planner.works(rows))):
                self._finished(output)
        finally:
            self.writer.flush()
            self.timeline.write()
            self.progress.close()

    def _check_model(self, fp: dict, model_digest: str, model_revision: str | None) -> None:
        fp["model_digest"], fp["model_revision"] = model_digest, model_revision
        self.out.check_fingerprint(fp, keys=list(MODEL_KEYS))

    def _write_job(self, fp: dict, scan: Scan) -> None:
        """Record the job before its first part is committed, so that every part belongs to a known job."""
        meta = self.out.read_job() or {"created": now_iso()}
        self.out.write_job(
            {
                **meta,
                "fingerprint": fp,
                "rows_total": scan.total,
                "job": self.job.model_dump(mode="json"),
                "fingerprint_sha256": hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest(),
            }
        )

    def _requests(self, works: Iterable[Work]) -> Iterator:
        from batchjob.engine.engine import Request

        for work in works:
            if self.stopper.signum is not None:
                return
            self.in_flight[work.request_id] = work
            yield Request(work.request_id, work.token_ids, work.params)

    def _on_step(self, metrics: StepMetrics) -> None:
        self.progress.step(metrics)
        self.timeline.add(metrics)
        self.writer.flush_if_due()
        if self.stopper.signum is not None and not self.stop_committed:
            self.stop_committed = True
            self.engine.abort_waiting()  # the grace is for requests already running, not the queue
            self.writer.flush()  # commit what is finished now, in case a kill -9 follows the signal
            self.progress.message(
                f"stopping: {len(self.in_flight)} requests in flight get up to "
                f"{self.stopper.grace:g} s to finish (signal again to drop them now)"
            )
        if self.stopper.drop_in_flight and not self.aborted:
            self.aborted = True
            self.engine.abort_all()

    def _finished(self, output: RequestOutput) -> None:
        work = self.in_flight.pop(output.request_id)
        if output.finish_reason == "abort":
            return  # not committed, so it runs again on resume
        for record in result_rows(work, output):
            self.writer.add(record)
        self.progress.rows(
            len(work.rows),
            output_tokens=len(output.token_ids),
            prompt_tokens=len(work.token_ids) - output.num_cached_tokens,
        )

    def _row_failed(self, row: Row, error: str) -> None:
        self.writer.add(failed_row(row, error))
        self.progress.rows(1)

    def _finish(self, committed: Committed, total: int, wall_time: float) -> int:
        job, out = self.job, self.out
        if committed.rows != total:
            raise RuntimeError(f"{total - committed.rows} of {total} rows got no result from the engine")
        if job.output.order == "input":
            out.staging.mkdir(exist_ok=True)
            sort_parts(out.parts(), out.staging, job.output.rows_per_file)
            write_atomic(out.staging / STAGED, lambda f: None)
            out.publish_sorted()
        if job.output.format == "openai-batch":
            write_openai_output(out.parts(), out.path / OPENAI_OUTPUT, job.model)
        stats = self.progress.stats
        generating = time.monotonic() - stats.started  # the rates leave out the model load
        summary = {
            "rows_total": total,
            "rows_ok": committed.rows - committed.failed,
            "rows_failed": committed.failed,
            "prompt_tokens": committed.prompt_tokens,
            "output_tokens": committed.output_tokens,
            "cached_tokens": committed.cached_tokens,
            "this_run": {
                "rows": stats.rows,
                "wall_time_s": round(wall_time, 3),
                "output_tokens_per_s": round(stats.output_tokens / generating, 2),
                "total_tokens_per_s": round((stats.output_tokens + stats.prompt_tokens) / generating, 2),
                "preemptions": stats.preemptions,
            },
            "finished": now_iso(),
        }
        if self.engine is not None:
            summary["this_run"]["token_budget"] = self.engine.token_budget
            if self.engine.auto_budget is not None:
                tuned = summary["this_run"]["token_budget_auto"] = self.engine.auto_budget.summary()
                rates = ", ".join(f"{b}: {r:,.0f}" for b, r in tuned["tokens_per_s_by_budget"].items())
                self.progress.message(
                    f"max_num_batched_tokens auto: chose {tuned['budget']} (tokens/s by budget: "
                    f"{rates or 'no step filled a budget'})"
                )
        out.write_success(summary)
        self.progress.message(
            f"done: {summary['rows_ok']} rows ok, {summary['rows_failed']} failed; results in {out.data}"
        )
        return self._write_metrics(committed, total, self._exit_code(committed.failed))

    def _write_metrics(self, committed: Committed, total: int, code: int) -> int:
        """metrics.prom at the end of a run that got to generate; returns `code`."""
        t, labels = self.timeline, {"model_name": self.job.model, "output": str(self.out.path.resolve())}
        write_metrics(
            self.out.path / METRICS,
            labels,
            committed,
            total,
            exit_code=code,
            last_success=self.out.success_time(),
            preemptions=t and t.preemptions,
            kv_cache_usage=t and t.kv_cache_usage_mean,
        )
        return code

    def _already_done(self) -> int:
        summary = self.out.read_summary() or {}
        self.progress.message(f"{self.out.path} is already complete (_SUCCESS, same job): nothing to do")
        return self._exit_code(summary.get("rows_failed", 0))

    def _exit_code(self, failed: int) -> int:
        return EXIT_ROW_ERRORS if failed and self.job.fail_on_row_errors else EXIT_OK
