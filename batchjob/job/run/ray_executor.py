"""`executor: ray`: the job's rows in shards through Ray actors that each hold one engine.

The driver does what a local run does around the work (lock, fingerprint, resume, bad rows, the final files) and is
the only writer of the output folder: a worker returns each shard's result rows and the driver commits them as the
parts a local run writes. So the layout, resume, `status` and `_SUCCESS` are a local run's, the workers need no
access to the output folder, and a shard that Ray redoes because its worker died is committed once.

A Parquet input at a URL (s3://, gs://, ...) is read by the workers themselves: a shard is a range of input positions
and which of them are done, and the worker reads those rows from the store, so they never pass through the driver.
Local files and JSON lines are read by the driver and sent in shards (a local path may not exist on other nodes, and
a JSON line's position is known only by reading its file up to it)."""

from __future__ import annotations

import itertools
import json
import logging
import pickle
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from batchjob.job.contracts import Embedder, JobEngine, model_identity
from batchjob.job.input.planner import EmbeddingPlanner, Work, job_planner, requests
from batchjob.job.input.reader import InputSource, Row
from batchjob.job.input.scoring import ScoreGather, ScoreWork, cached_tokens, score_planner, score_requests
from batchjob.job.output.lora_counts import LoraCounts
from batchjob.job.output.schema import (
    embedding_schema,
    failed_row,
    prompt_columns,
    result_rows,
    result_schema,
    score_rows,
    score_schema,
)
from batchjob.job.output.state import StateError
from batchjob.job.output.storage import is_url
from batchjob.job.run.executor import Pending, computed_prompt_tokens, embedding_calls, embedding_records
from batchjob.job.run.stopper import Interrupted
from batchjob.job.spec import JobFileError, JobSpec, RaySpec
from batchjob.job.telemetry.timeline import Timeline

try:
    import ray
    from ray.util import ActorPool
except ImportError:
    raise JobFileError(
        "executor: 'ray' needs Ray, an optional extra: pip install 'batchjob[ray]' (or pip install 'ray[data]')"
    ) from None

ROW = "row"  # the one column of an input shard: each Row pickled as the local reader made it
# Result schema metadata: the model a worker ran (contracts.model_identity, as JSON), for the job's fingerprint, and
# the tokens it computed for the shard ({"prompt_tokens", "output_tokens"}, as JSON), for the progress line: counted
# by work, as a local run counts them, since its rows' token columns do not add up to them (duplicates, labels);
# with engine.lora, the adapter of each row the model ran ({row's position in the shard's table: name or null}, as
# JSON), which the driver's parts record and its counts add up.
MODEL, TOKENS, LORA = b"model", b"tokens", b"lora"


@dataclass(frozen=True)
class RowRange:
    """A shard that a worker reads itself: input positions start..stop-1, and which an earlier run committed."""

    start: int
    stop: int
    done: bytes  # a byte a position, 1 where done


class EngineWorker:
    """A Ray actor: loads the model once, then turns shards of rows into result rows, in the planner's order."""

    def __init__(
        self,
        job: JobSpec,
        passthrough: pa.Schema,
        engine_factory: Callable[[JobSpec], JobEngine | Embedder],
        versions: dict[str, list],
    ):
        self.job, self.versions = job, versions
        self.source: InputSource | None = None  # opened with the first RowRange
        self.engine = engine_factory(job)
        self.records: list[dict] = []  # the result rows of the shard in hand
        self.tokens = {"prompt_tokens": 0, "output_tokens": 0}  # that the engine computed for it

        def on_error(row: Row, error: str) -> None:
            self.records.append(failed_row(row, error))

        self.per_line = job.input.format == "openai-batch"  # an embedding job's rows: a list of embeddings a line
        if job.task == "embed":
            self.planner = EmbeddingPlanner(job, self.engine, on_error)
            schema = embedding_schema(passthrough, self.engine.dimension, self.per_line)
        elif job.task == "score":
            self.planner = score_planner(job, self.engine, on_error)
            schema = score_schema(passthrough, job.score.labels is not None, job.score.prompt_logprobs is not None)
        else:
            self.planner = job_planner(job, self.engine, on_error)
            prompt = prompt_columns(job.input.format, job.sampling.prompt_logprobs)
            schema = result_schema(passthrough, reasoning=job.output.split_reasoning, prompt=prompt)
        self.schema = schema.with_metadata({MODEL: json.dumps(model_identity(self.engine))})

    def run_shard(self, shard: pa.Table | RowRange) -> pa.Table:
        if isinstance(shard, RowRange):
            self.source = self.source or InputSource(self.job, self.versions)
            rows = self.source.rows_between(shard.start, shard.stop)
            rows = (row for row in rows if not shard.done[row.index - shard.start])
        else:
            rows = (pickle.loads(b) for b in shard.column(ROW).to_pylist())
        self.records, works = [], {}
        self.tokens = {"prompt_tokens": 0, "output_tokens": 0}
        self.ran: dict[str, str | None] = {}
        if self.job.task == "embed":
            for call in embedding_calls(self.planner.works(rows), self.engine):
                self.records += embedding_records(self.engine, call, self.per_line)
                self.tokens["prompt_tokens"] += sum(w.prompt_tokens for w in call)
        elif self.job.task == "score":
            self._score(rows)
        else:
            for output in self.engine.stream(requests(self.planner.works(rows), works)):
                work = works.pop(output.request_id)
                self._ran(work, result_rows(work, output, self.engine.tokenizer, self.job.output.split_reasoning))
                self.tokens["prompt_tokens"] += computed_prompt_tokens(work, [output])
                self.tokens["output_tokens"] += sum(len(s.token_ids) for s in output.samples)
        table = pa.Table.from_pylist(self.records, schema=self.schema)
        extra = {LORA: json.dumps(self.ran)} if self.job.engine.lora is not None else {}
        return table.replace_schema_metadata({**self.schema.metadata, TOKENS: json.dumps(self.tokens), **extra})

    def _ran(self, work: Work | ScoreWork, records: list[dict]) -> None:
        """`work`'s result rows, which the model ran through its adapter."""
        if self.job.engine.lora is not None:
            self.ran |= {str(i): work.lora for i in range(len(self.records), len(self.records) + len(records))}
        self.records += records

    def _score(self, rows: Iterable[Row]) -> None:
        works, gather = {}, ScoreGather()
        per_token = self.job.score.prompt_logprobs is not None
        for output in self.engine.stream(score_requests(self.planner.works(rows), works)):
            work = works.pop(output.request_id)
            outputs = gather.add(work, output)
            if outputs is not None:
                score = work.score(outputs)
                self._ran(work, score_rows(work, score, self.engine.tokenizer, per_token, cached_tokens(outputs)))
                self.tokens["prompt_tokens"] += computed_prompt_tokens(work, outputs)


class RayExecutor:
    """Generation spread over Ray workers; the driver commits each shard's results as a local run's parts."""

    timeline: Timeline | None = None  # the steps happen on the workers

    def __init__(self, spec: RaySpec, engine_factory: Callable[[JobSpec], JobEngine]):
        self.spec, self.engine_factory = spec, engine_factory
        self.model: dict | None = None
        self.written: set[str] = set()  # ids committed by this run (earlier runs' ids never reach the workers)
        self.lora_rows = LoraCounts()  # the committed shards' counts

    def execute(self, pending: Pending) -> None:
        started = connect(self.spec)
        try:
            self._run_shards(pending)
        finally:
            if started:
                ray.shutdown()

    def engine_summary(self) -> dict:
        lora = self.lora_rows.summary()
        return {} if lora is None else {"lora": lora}

    def _run_shards(self, pending: Pending) -> None:
        spec = self.spec
        worker = ray.remote(EngineWorker).options(
            num_cpus=spec.num_cpus_per_worker,
            num_gpus=spec.num_gpus_per_worker,
            max_restarts=-1,  # a worker that dies comes back (loading the model again) ...
            max_task_retries=-1,  # ... and redoes the shard it had
        )
        source = pending.source
        actors = [
            worker.remote(pending.job, pending.scan.passthrough_schema, self.engine_factory, source.versions)
            for _ in range(spec.num_workers)
        ]
        pool = ActorPool(actors)
        pending.start()
        if source.format == "parquet" and is_url(pending.job.input.path):
            shards: Iterable[pa.Table | RowRange] = ranges(pending.done, spec.shard_rows)
        else:
            shards = to_shards(pending.rows, spec.shard_rows)
        try:
            # One shard a worker in flight, and the next in the driver's hand: the input streams through, and the
            # object store never holds more than num_workers shards of it.
            for shard in shards:
                while not pool.has_free():
                    if not self._commit_next(pool, pending):
                        return
                if pending.stopper.stopping:
                    return
                pool.submit(lambda actor, table: actor.run_shard.remote(table), shard)
            while pool.has_next():
                if not self._commit_next(pool, pending):
                    return
        finally:
            for actor in actors:  # stops the shards in flight when the run ends early
                ray.kill(actor)

    def _commit_next(self, pool: ActorPool, pending: Pending) -> bool:
        """Commit the next shard a worker finishes; False when a signal ended the wait."""
        try:
            # Waiting on Ray can take a shard's time; a signal ends the wait, and the shards in flight
            # (uncommitted) run again on resume.
            with pending.stopper.interruptible():
                table = pool.get_next_unordered()
        except Interrupted:
            return False
        self._commit(table, pending)
        return True

    def _commit(self, table: pa.Table, pending: Pending) -> None:
        model = json.loads(table.schema.metadata[MODEL])
        if self.model is None:  # the first results: now the model is known, and so is the whole job
            # the rows' columns first: model_known checks that the folder's parts can join them
            pending.writer.schema = table.schema.remove_metadata()  # an embedding's length is the model's
            pending.model_known(model)
            self.model = model
        elif model != self.model:
            raise StateError(
                f"Ray workers run different models or numerics ({self.model} and {model}): the model path must "
                "hold the same files on every node, and the workers run on one kind of device"
            )
        # Ray redoes the shard of a worker that died; should it ever hand over both results, one is kept.
        written = self.written
        ran = json.loads(table.schema.metadata.get(LORA, b"{}"))
        fresh = []
        for i, record in enumerate(table.to_pylist()):
            if record["id"] in written:
                continue
            written.add(record["id"])
            fresh.append(record)
            pending.writer.add(record, model_ran=str(i) in ran, lora=ran.get(str(i)))
            if str(i) in ran:
                self.lora_rows.add(ran[str(i)], 1, record["error"] is not None)
        # A shard is redone whole: its rows are all fresh, or all committed already (and its tokens counted).
        if fresh and LORA in table.schema.metadata:
            pending.progress.lora(self.lora_rows.summary())
        pending.progress.rows(len(fresh), **(json.loads(table.schema.metadata[TOKENS]) if fresh else {}))


def connect(spec: RaySpec) -> bool:
    """Join the cluster, or start a local instance; True when this run started Ray and so must stop it."""
    if ray.is_initialized():
        return False  # the caller's own Ray (a notebook, a test), used as it is
    ray.init(address=spec.address, logging_level=logging.WARNING)
    return True


def ranges(done: np.ndarray, size: int) -> Iterator[RowRange]:
    """The input positions in shards of `size`, leaving out shards whose rows are all done."""
    for start in range(0, len(done), size):
        mask = done[start : start + size]
        if not mask.all():
            yield RowRange(start, start + len(mask), mask.astype(np.uint8).tobytes())


def to_shards(rows: Iterable[Row], size: int) -> Iterator[pa.Table]:
    """The rows in input order, `size` a shard, read as they are asked for; workers get rows exactly as the local
    reader made them, bad rows and all."""
    rows = iter(rows)
    while chunk := list(itertools.islice(rows, size)):
        yield pa.table({ROW: pa.array([pickle.dumps(row) for row in chunk], pa.large_binary())})
