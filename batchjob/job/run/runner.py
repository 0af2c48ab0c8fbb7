"""One run of a job: check, resume, hand the pending rows to an executor (executor.py), finish the folder.

The exit codes it returns are exit_codes.py's."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable

from batchjob.job.cache.results_cache import RESULT_ENGINE_SETTINGS
from batchjob.job.contracts import JobEngine
from batchjob.job.exit_codes import EXIT_OK, EXIT_ROW_ERRORS, EXIT_SIGNAL
from batchjob.job.input.reader import InputSource, Scan
from batchjob.job.output.lock import describe
from batchjob.job.output.schema import prompt_columns, result_schema
from batchjob.job.output.state import METRICS, OPENAI_OUTPUT, TIMELINE, Committed, OutputDir, StateError, now_iso
from batchjob.job.output.storage import display
from batchjob.job.output.writer import PartWriter, conform_parts, folder_schema, sort_parts, write_openai_output
from batchjob.job.run.executor import Executor, LocalExecutor, Pending, load_engine
from batchjob.job.run.stopper import Stopper
from batchjob.job.spec import JobSpec
from batchjob.job.telemetry.progress import Progress
from batchjob.job.telemetry.prom import metric_families, write_metrics
from batchjob.model.lora.files import adapter_digests

MODEL_KEYS = ("model_digest", "model_revision", "numerics")  # the parts known once the model is loaded


def fingerprint(job: JobSpec, source: InputSource, model_digest: str | None) -> dict:
    """What makes two runs' results belong to one dataset. Engine tuning (batch sizes, memory, preemption) may change
    between runs; the engine settings that change what is computed may not."""
    fp = {
        "model": job.model,
        "task": job.task,
        "model_digest": model_digest,
        "model_revision": None,  # the Hub commit, known with the digest
        "numerics": None,  # the resolved device, dtypes and ops backend, known with the digest
        "prompt": job.prompt.model_dump(),
        "sampling": job.sampling.model_dump(),
        # What a scoring job scores (only there: the fingerprints of earlier jobs stay as they were).
        **({"score": job.score.model_dump()} if job.task == "score" else {}),
        "engine": job.engine.model_dump(include=RESULT_ENGINE_SETTINGS),
        # Each LoRA adapter's content by name: rows computed through an adapter belong to that adapter's weights.
        "lora": adapter_digests(job.engine.lora.adapters) if job.engine.lora else None,
        # The published files' layout: a rerun with another size must not leave the old files beside the new ones.
        "output": {
            "rows_per_file": job.output.rows_per_file if job.output.order == "input" else None,
            "split_reasoning": job.output.split_reasoning,
        },
        "input": {
            **job.input.model_dump(include={"format", "id_column", "text_column", "messages_column", "passthrough"}),
            "files": source.identity(),
            # The image column's name only: the files behind its paths are not in `files` (docs/job-file.md).
            **({"image_column": job.input.image_column} if job.input.image_column else {}),
            # rows whose image is an http(s) URL fail without it (only where set: older fingerprints stay as they were)
            **({"allow_urls": True} if job.input.allow_urls else {}),
        },
    }
    return json.loads(json.dumps(fp))  # as it reads back from _job.json, for comparing


def run_job(
    job: JobSpec,
    progress: Progress,
    *,
    restart: bool = False,
    allow_numerics_change: bool = False,
    grace: float = 10.0,
    engine_factory: Callable[[JobSpec], JobEngine] = load_engine,
) -> int:
    """The exit code of a run that got going; LockHeld, InputError, StateError and JobFileError when it cannot."""
    out = OutputDir(job.output.path, job.output.storage_options, job.output.lease_seconds)
    source = InputSource(job)  # before the lock, which would create the folder the input must not be in
    if job.executor == "ray":
        from batchjob.job.run.ray_executor import RayExecutor  # Ray is an optional extra, imported only when asked for

        executor: Executor = RayExecutor(job.ray, engine_factory)
    else:
        executor = LocalExecutor(engine_factory, out.path / TIMELINE)
    with out.lock() as lock, Stopper(grace) as stopper:
        if lock.stale and lock.stale.get("pid"):
            progress.message(f"took over the lock of a run that is gone ({describe(lock.stale)})")
        try:
            return JobRun(job, out, progress, stopper, executor, allow_numerics_change).run(source, restart)
        finally:
            out.discard_unused(lock)


class JobRun:
    """Everything around generation: recover, fingerprint, resume, then the executor, then the final files."""

    def __init__(
        self,
        job: JobSpec,
        out: OutputDir,
        progress: Progress,
        stopper: Stopper,
        executor: Executor,
        allow_numerics_change: bool = False,
    ):
        self.job, self.out, self.progress, self.stopper, self.executor = job, out, progress, stopper, executor
        self.allow_numerics_change = allow_numerics_change

    def run(self, source: InputSource, restart: bool) -> int:
        job, out = self.job, self.out
        started = time.monotonic()
        for part in out.recover():
            self.progress.message(f"quarantined the damaged part {part.name} in {part.parent}; its rows will be redone")
        fp = fingerprint(job, source, None)
        if restart:
            out.reset()
            self.progress.message(f"--restart: discarded earlier results in {out.path}")
        # Everything but the model digest is known before the slow model load, so a mismatch fails at once.
        out.check_fingerprint(fp, keys=[k for k in fp if k not in MODEL_KEYS])
        meta = out.read_job()
        if out.complete(meta):  # a _SUCCESS that no _job.json explains, or with rows missing, proves nothing
            return self._already_done()
        if out.succeeded and meta is not None:
            out.invalidate()
            self.progress.message(f"{out.path} was finished but rows are missing since; they will be redone")
        scan = source.scan()
        committed = out.committed()
        if committed.rows < scan.total and not self.stopper.stopping:
            if committed.rows:
                self.progress.message(f"resuming: {committed.rows} of {scan.total} rows already done")
            self._generate(source, scan, committed, fp)
        result = out.committed(with_ids=False)
        if result.rows < scan.total and self.stopper.stopping:
            self.progress.message(f"interrupted: {result.rows} of {scan.total} rows committed; run again to resume")
            return self._write_metrics(result, scan.total, EXIT_SIGNAL[self.stopper.signum])
        if out.read_job() is None:  # no row needed the model (an empty input): the job is recorded all the same
            self._write_job(fp, scan, None)
        return self._finish(result, scan.total, time.monotonic() - started)

    def _generate(self, source: InputSource, scan: Scan, committed: Committed, fp: dict) -> None:
        job, out = self.job, self.out
        writer = PartWriter(
            out.data,
            result_schema(
                scan.passthrough_schema,
                reasoning=job.output.split_reasoning,
                prompt=prompt_columns(job.input.format, job.sampling.prompt_logprobs),
            ),
            checkpoint_rows=job.output.checkpoint_rows,
            checkpoint_seconds=job.output.checkpoint_seconds,
            next_part=out.next_part_number(),
            run_tag=out.run_tag,
            before_commit=lambda: (out.check_held(), source.check_reading()),
            count_lora=job.engine.lora is not None,
        )

        def model_known(identity: dict) -> None:
            fp.update(json.loads(json.dumps(identity)))
            meta = out.read_job()
            # A job recorded without a model (its input was empty) has no result that a model computed.
            if meta and meta["fingerprint"].get("model_digest") is not None:
                out.check_fingerprint(fp, keys=["model_digest", "model_revision", "lora"])
            # The rows' columns are known now (an embedding's length is the model's): refused before any is computed
            # if the folder's parts could not join them in one dataset at the finish.
            folder_schema(out.parts(), writer.schema)
            self._write_job(fp, scan, meta, self._numerics_change(meta, fp["numerics"], committed.rows))
            out.own(TIMELINE)  # a local executor's engine steps from now on

        done = committed.done_at(scan.ids)
        pending = Pending(job, source, scan, committed, done, writer, self.progress, self.stopper, model_known)
        try:
            self.executor.execute(pending)
        finally:
            writer.flush()
            self.progress.close()

    def _numerics_change(self, meta: dict | None, numerics: dict, committed_rows: int) -> dict | None:
        """Refuse to add results computed under other numerics than the `committed_rows` earlier ones (as `meta`,
        the _job.json, records them), unless allowed; then the change is what _job.json records."""
        if meta is None or not committed_rows:
            return None
        earlier = meta["fingerprint"].get("numerics")  # None: written by a batchjob that did not record them
        if earlier and "ops_backend" not in earlier and earlier.get("device") == "cpu" == numerics.get("device"):
            # an embedding job's record from before embedders ran anywhere but a CPU, whose ops are unchanged since
            earlier = {**earlier, "ops_backend": numerics.get("ops_backend")}
        if earlier == numerics:
            return None
        was = earlier or {}
        keys = dict.fromkeys([*numerics, *was])  # a key of either: one recorded only where set ("weights: w8a8")
        differs = ", ".join(
            f"{k} {was.get(k, 'unrecorded')} -> {numerics.get(k, 'unrecorded')}"
            for k in keys
            if was.get(k) != numerics.get(k)
        )
        if not self.allow_numerics_change:
            raise StateError(
                f"{self.out.path} holds results computed under other numerics ({differs}): adding to them would mix "
                "two sets of numbers in one dataset. Run where they were computed, pass --allow-numerics-change to "
                "add to them anyway (recorded in _job.json), or --restart to start over"
            )
        self.progress.message(f"--allow-numerics-change: adding results computed with {differs}")
        return {"at": now_iso(), "from": earlier, "to": numerics}

    def _write_job(self, fp: dict, scan: Scan, meta: dict | None, numerics_change: dict | None = None) -> None:
        """Record the job before its first part is committed, so that every part belongs to a known job; `meta` is
        what _job.json held."""
        meta = dict(meta or {"created": now_iso(), "files": []})
        if numerics_change:
            meta["numerics_changes"] = [*meta.get("numerics_changes", []), numerics_change]
        self.out.write_job(
            {
                **meta,
                "fingerprint": fp,
                "rows_total": scan.total,
                "job": self.job.model_dump(mode="json"),
                "fingerprint_sha256": hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest(),
            }
        )

    def _finish(self, committed: Committed, total: int, wall_time: float) -> int:
        job, out = self.job, self.out
        if committed.rows != total:
            raise RuntimeError(f"{total - committed.rows} of {total} rows got no result from the engine")
        if job.output.order == "input":
            out.staging.mkdir(exist_ok=True)
            sort_parts(out.parts(), out.staging, job.output.rows_per_file)
            out.stage_complete()
            out.publish_sorted()
        else:
            conform_parts(out.parts())
        if job.output.format == "openai-batch" and out.own(OPENAI_OUTPUT):
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
            **({"cache": {"hits": committed.cache_hits, "misses": committed.cache_misses}} if job.cache else {}),
            # the whole job's rows by adapter, from the parts (the sorted files of `order: input` keep no count)
            **({"lora": committed.lora.counts()} if job.engine.lora else {}),
            "this_run": {
                "rows": stats.rows,
                "wall_time_s": round(wall_time, 3),
                "output_tokens_per_s": round(stats.output_tokens / generating, 2),
                "total_tokens_per_s": round((stats.output_tokens + stats.prompt_tokens) / generating, 2),
                "preemptions": stats.preemptions,
            },
            "finished": now_iso(),
        }
        summary["this_run"].update(self.executor.engine_summary())
        if tuned := summary["this_run"].get("token_budget_auto"):
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
        """metrics.prom at the end of a run that got to generate; returns `code`. Not before the job is recorded
        (a run stopped during its first model load): only a recorded name is batchjob's to write."""
        if not self.out.own(METRICS):
            return code
        t, labels = self.executor.timeline, {"model_name": self.job.model, "output": display(self.out.path)}
        families = metric_families(
            labels,
            committed,
            total,
            exit_code=code,
            last_success=self.out.success_time(),
            preemptions=t and t.preemptions,
            kv_cache_usage=t and t.kv_cache_usage_mean,
        )
        write_metrics(self.out.path / METRICS, families)
        return code

    def _already_done(self) -> int:
        # A folder finished by a batchjob that left its parts' schemas apart still reads as one dataset after this.
        conform_parts(self.out.parts())
        summary = self.out.read_summary() or {}
        self.progress.message(f"{self.out.path} is already complete (_SUCCESS, same job): nothing to do")
        return self._exit_code(summary.get("rows_failed", 0))

    def _exit_code(self, failed: int) -> int:
        return EXIT_ROW_ERRORS if failed and self.job.fail_on_row_errors else EXIT_OK
