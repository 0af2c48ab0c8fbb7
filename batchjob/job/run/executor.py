"""Where a run's pending rows are computed. The run (runner.py) hands an Executor its Pending work: the rows still
to compute and where their results go. LocalExecutor runs one engine in this process; ray_executor.RayExecutor
spreads shards over Ray workers. Both commit through the same PartWriter, so the output folder is the same."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol, TypeVar

import numpy as np

from batchjob.engine.host_memory import peak_rss
from batchjob.engine.outputs import Request, RequestOutput, ScoreOutput, StepMetrics
from batchjob.env import configure_threads
from batchjob.job.cache.results_cache import RunCache, open_cache
from batchjob.job.contracts import Embedder, JobEngine, model_identity
from batchjob.job.input.planner import EmbeddingPlanner, EmbeddingWork, Work, job_planner, requests
from batchjob.job.input.reader import InputSource, Row, Scan
from batchjob.job.input.scoring import ScoreGather, ScoreWork, cached_tokens, score_planner, score_requests
from batchjob.job.kv_pool import fit_job_pool, pool_report
from batchjob.job.output.lora_counts import LoraCounts
from batchjob.job.output.schema import (
    embedding_row,
    embedding_schema,
    failed_row,
    result_rows,
    score_rows,
    score_schema,
)
from batchjob.job.output.state import Committed
from batchjob.job.output.writer import PartWriter
from batchjob.job.run.stopper import Interrupted, Stopper
from batchjob.job.spec import JobSpec
from batchjob.job.telemetry.progress import Progress
from batchjob.job.telemetry.timeline import Timeline

# Tokens of the rows handed to the Embedder at once, in forward passes' worth: enough for its length sort to leave
# little padding, few enough that a stop or a checkpoint waits only seconds.
EMBED_CALL_BATCHES = 16
W = TypeVar("W", Work, ScoreWork)


def load_engine(job: JobSpec) -> JobEngine | Embedder:
    configure_threads()  # in a Ray worker, before torch loads
    from batchjob.engine.engine import Engine  # here, not at import: torch and the weights are slow to load

    task = "embed" if job.task == "embed" else "generate"  # a scoring job's rows are prompt-only generate requests
    return Engine(job.model, task=task, **job.engine_settings())


@dataclass
class Pending:
    """What a run hands its executor: the rows still to compute and where their results go."""

    job: JobSpec
    source: InputSource  # where `rows` come from
    scan: Scan
    committed: Committed  # by earlier runs
    done: np.ndarray  # by input position, whether an earlier run committed the row
    writer: PartWriter
    progress: Progress
    stopper: Stopper
    # contracts.model_identity of the engine, once loaded and before the first result is committed
    model_known: Callable[[dict], None]

    @property
    def rows(self) -> Iterator[Row]:
        """The rows still to compute, in input order: a fresh pass over the input each time."""
        return (row for row in self.source.rows() if not self.done[row.index])

    def start(self) -> None:
        """Generation begins (after the model load, which the run's rates leave out)."""
        self.progress.start(self.scan.total, self.committed.rows, self.job.task)

    def row_failed(self, row: Row, error: str) -> None:
        self.writer.add(failed_row(row, error))
        self.progress.rows(1)


class Executor(Protocol):
    timeline: Timeline | None  # the engine's steps, where the executor sees them

    def execute(self, pending: Pending) -> None:
        """Compute the pending rows and commit their results; return early once the stopper says stop."""

    def engine_summary(self) -> dict:
        """What the engine settled on (token budget) and the peak resident memory of its process, for _SUCCESS's
        `this_run`; empty where unknown."""


class LocalExecutor:
    """One engine in this process. Its step callbacks drive checkpoints, progress, the timeline and the stop."""

    def __init__(self, engine_factory: Callable[[JobSpec], JobEngine], timeline_path: Path):
        self.engine_factory, self.timeline_path = engine_factory, timeline_path
        self.timeline: Timeline | None = None
        self.engine: JobEngine | None = None
        self.pending: Pending | None = None
        self.in_flight: dict[str, Work | ScoreWork] = {}  # by request id
        self.cache: RunCache | None = None
        self.stop_committed = self.aborted = False
        self.lora_rows = LoraCounts()  # with engine.lora

    def execute(self, pending: Pending) -> None:
        self.pending = pending
        try:
            with pending.stopper.interruptible(signals=2):  # a second Ctrl-C does not wait for the load
                self.engine = self.engine_factory(pending.job)
        except Interrupted:
            return
        self.cache = open_cache(pending.job, self.engine, pending.progress.message)
        try:
            if pending.job.task == "embed":
                self.embed(pending, self.engine)
            elif pending.job.task == "score":
                self.score(pending, self.engine)
            else:
                self.generate(pending, self.engine)
        finally:
            if self.cache is not None:
                self.cache.cache.evict()

    def generate(self, pending: Pending, engine: JobEngine) -> None:
        fit_job_pool(pending.job, engine, pending.rows)
        planner = job_planner(pending.job, engine, pending.row_failed, pending.progress.message)
        misses = self.cache and (lambda works: self.cache.generation_misses(works, self.commit_hit))
        # a row whose image no longer reads when its request is made (a file changed since it was planned) fails
        to_requests = functools.partial(requests, on_error=pending.row_failed)
        self._stream(pending, engine, planner.works, misses, to_requests, self.commit)

    def score(self, pending: Pending, engine: JobEngine) -> None:
        """A scoring job: its rows' prompt-only requests streamed through the engine, which packs them into its
        token budget; a row is committed once all its requests (one a label) are done."""
        planner = score_planner(pending.job, engine, pending.row_failed, pending.progress.message)
        spec = pending.job.score
        labels, per_token = spec.labels is not None, spec.prompt_logprobs is not None
        pending.writer.schema = score_schema(pending.scan.passthrough_schema, labels, per_token)
        misses = self.cache and (lambda works: self.cache.score_misses(works, self.commit_score_hit))
        gather = ScoreGather()

        def on_output(output: RequestOutput) -> None:
            work = self.in_flight.pop(output.request_id)
            outputs = gather.add(work, output)
            if outputs is not None:
                self.commit_score(work, outputs)

        self._stream(pending, engine, planner.works, misses, score_requests, on_output)

    def _stream(
        self,
        pending: Pending,
        engine: JobEngine,
        works: Callable[[Iterable[Row]], Iterator[W]],
        misses: Callable[[Iterable[W]], Iterator[W]] | None,
        to_requests: Callable[[Iterable[W], dict], Iterator[Request]],
        on_output: Callable[[RequestOutput], None],
    ) -> None:
        """The planner's works of the pending rows (less the results cache's hits, through `misses`) as requests
        (`to_requests`) through the engine, each output to `on_output`; the engine's steps drive checkpoints and the
        stop (on_step)."""
        pending.model_known(model_identity(engine))
        if pending.stopper.stopping:  # stopped during the model load: nothing started, nothing to commit
            return
        pending.start()
        self.timeline = Timeline(self.timeline_path)
        engine.add_step_callback(self.on_step)
        planned = itertools.takewhile(lambda _: not pending.stopper.stopping, works(pending.rows))
        if misses:
            planned = misses(planned)
        try:
            for output in engine.stream(to_requests(planned, self.in_flight)):
                on_output(output)
        finally:
            self.timeline.write()

    def embed(self, pending: Pending, embedder: Embedder) -> None:
        """An embedding job: the rows' inputs go to the Embedder a few forward passes' worth at a time, and their
        rows are committed as they come back; a stop waits for the call under way only."""
        per_line = pending.job.input.format == "openai-batch"
        pending.writer.schema = embedding_schema(pending.scan.passthrough_schema, embedder.dimension, per_line)
        planner = EmbeddingPlanner(pending.job, embedder, pending.row_failed)
        pending.model_known(model_identity(embedder))
        if pending.stopper.stopping:
            return
        pending.start()
        works = planner.works(pending.rows)
        store, looked_up = None, None
        if self.cache is not None:
            store, looked_up = self.cache.store_embeddings, "misses"

            def on_hit(work: EmbeddingWork, vectors: list[list[float]]) -> None:
                record = embedding_row(
                    work.row, _shortened(embedder, work, vectors), work.prompt_tokens, work.truncated, per_line
                )
                pending.writer.add(record, cache="hits")
                pending.progress.rows(1)

            works = self.cache.embedding_misses(works, on_hit)
        for call in embedding_calls(works, embedder):
            if pending.stopper.stopping:
                return
            for record in embedding_records(embedder, call, per_line, store):
                pending.writer.add(record, cache=looked_up)
            pending.progress.rows(len(call), prompt_tokens=sum(w.prompt_tokens for w in call))

    def on_step(self, metrics: StepMetrics) -> None:
        p = self.pending
        p.progress.step(metrics)
        self.timeline.add(metrics)
        p.writer.flush_if_due()
        if p.stopper.stopping and not self.stop_committed:
            self.stop_committed = True
            self.engine.abort_waiting()  # the grace is for requests already running, not the queue
            p.writer.flush()  # commit what is finished now, in case a kill -9 follows the signal
            p.progress.message(
                f"stopping: {len(self.in_flight)} requests in flight get up to "
                f"{p.stopper.grace:g} s to finish (signal again to drop them now)"
            )
        if p.stopper.drop_in_flight and not self.aborted:
            self.aborted = True
            self.engine.abort_all()

    def commit(self, output: RequestOutput) -> None:
        work = self.in_flight.pop(output.request_id)
        looked_up = self.cache is not None and self.cache.looked_up(work)
        if looked_up:
            self.cache.store(work, output)
        if output.finish_reason == "abort":
            return  # not committed, so it runs again on resume
        for record in result_rows(work, output, self.engine.tokenizer, self.pending.job.output.split_reasoning):
            self.pending.writer.add(record, cache="misses" if looked_up else None, model_ran=True, lora=work.lora)
        self._count_lora(work, output.finish_reason == "error")
        self.pending.progress.rows(
            len(work.rows),
            output_tokens=sum(len(s.token_ids) for s in output.samples),
            prompt_tokens=computed_prompt_tokens(work, [output]),
        )

    def commit_hit(self, work: Work, output: RequestOutput) -> None:
        """A work whose result the results cache holds: its rows as if the engine had just computed it."""
        for record in result_rows(work, output, self.engine.tokenizer, self.pending.job.output.split_reasoning):
            self.pending.writer.add(record, cache="hits", model_ran=True, lora=work.lora)
        self._count_lora(work, output.finish_reason == "error")
        self.pending.progress.rows(len(work.rows))

    def commit_score(self, work: ScoreWork, outputs: list[RequestOutput]) -> None:
        if any(o.finish_reason == "abort" for o in outputs):
            return  # not committed, so it runs again on resume
        score = work.score(outputs)
        looked_up = self.cache is not None and self.cache.looked_up(work)
        if looked_up:
            self.cache.store_score(work, score)
        self._add_scored(work, score, cached_tokens(outputs), "misses" if looked_up else None)
        self.pending.progress.rows(len(work.rows), prompt_tokens=computed_prompt_tokens(work, outputs))

    def commit_score_hit(self, work: ScoreWork, score: ScoreOutput) -> None:
        """A work whose score the results cache holds: its rows as if the engine had just scored it."""
        self._add_scored(work, score, work.total_tokens, "hits")
        self.pending.progress.rows(len(work.rows))

    def _add_scored(self, work: ScoreWork, score: ScoreOutput, cached: int, cache: str | None) -> None:
        per_token = self.pending.job.score.prompt_logprobs is not None
        for record in score_rows(work, score, self.engine.tokenizer, per_token, cached):
            self.pending.writer.add(record, cache=cache, model_ran=True, lora=work.lora)
        self._count_lora(work, score.error is not None)

    def _count_lora(self, work: Work | ScoreWork, failed: bool) -> None:
        if self.pending.job.engine.lora is not None:
            self.lora_rows.add(work.lora, len(work.rows), failed)
            self.pending.progress.lora(self.lora_rows.summary())

    def engine_summary(self) -> dict:
        if self.engine is None:
            return {}
        if self.pending.job.task == "embed":
            config = self.engine.config
            return {
                "max_num_batched_tokens": config.max_num_batched_tokens,
                **asdict(self.engine.stats),
                "peak_rss_bytes": peak_rss(),
            }
        summary = {"token_budget": self.engine.token_budget, **pool_report(self.engine), "peak_rss_bytes": peak_rss()}
        if (lora := self.lora_rows.summary()) is not None:
            summary["lora"] = lora
        if self.engine.auto_budget is not None:
            summary["token_budget_auto"] = self.engine.auto_budget.summary()
        return summary


def computed_prompt_tokens(work: Work | ScoreWork, outputs: list[RequestOutput]) -> int:
    """The prompt tokens that the engine computed for a work, less those it read from the prefix cache: the progress
    line's count under either executor. A scoring work's requests each hold the prompt (one a label), and the labels
    after the first read it from the cache: its rows' prompt_tokens count the prompt once, its cached_tokens every
    read, so a row's difference is no count of work."""
    tokens = work.total_tokens if isinstance(work, ScoreWork) else len(work.token_ids)
    return tokens - cached_tokens(outputs)


def embedding_records(
    embedder: Embedder,
    works: list[EmbeddingWork],
    per_line: bool,
    store: Callable[[EmbeddingWork, list[list[float]]], None] | None = None,
) -> list[dict]:
    """The output rows of `works`, their inputs embedded in one Embedder call; `store` takes each row's vectors at
    the model's dimension (for the results cache)."""
    outputs = iter(embedder.embed([ids for w in works for ids in w.inputs], use_tqdm=False))
    records = []
    for work in works:
        vectors = [next(outputs).embedding for _ in work.inputs]
        if store is not None:
            store(work, vectors)
        vectors = _shortened(embedder, work, vectors)
        records.append(embedding_row(work.row, vectors, work.prompt_tokens, work.truncated, per_line))
    return records


def _shortened(embedder: Embedder, work: EmbeddingWork, vectors: list[list[float]]) -> list[list[float]]:
    """A row's vectors cut to its `dimensions`, where it asks for fewer."""
    if work.dimensions is None:
        return vectors
    return [embedder.shorten(v, work.dimensions) for v in vectors]


def embedding_calls(works: Iterable[EmbeddingWork], embedder: Embedder) -> Iterator[list[EmbeddingWork]]:
    """`works` in groups of a few forward passes' worth of input tokens: one Embedder call each."""
    works = iter(works)
    while call := list(_up_to_tokens(works, EMBED_CALL_BATCHES * embedder.config.max_num_batched_tokens)):
        yield call


def _up_to_tokens(works: Iterable[EmbeddingWork], budget: int) -> Iterable[EmbeddingWork]:
    """The next works from `works` up to `budget` input tokens (at least one)."""
    tokens = 0
    for work in works:
        yield work
        tokens += work.prompt_tokens
        if tokens >= budget:
            return
