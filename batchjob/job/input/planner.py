"""Rows to engine work, ordered for throughput over a bounded window of rows.

Within a window, prompts are sorted by their token ids, which puts prompts sharing a prefix (same system text and
template head) next to each other, so their KV blocks are reused while still cached; each such group, and the pool
of prompts that share nothing, is then binned by length so that similar lengths run in the same batches. Identical
requests under deterministic sampling become one piece of work whose result is written for every row.

`job_planner` is the one place a job's rows become engine requests (PromptBuilder, its check, Planner); the local
and Ray executors, `batchjob plan` and `batchjob bench --job` all use it."""

from __future__ import annotations

import hashlib
import itertools
import math
from array import array
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import pydantic

from batchjob.engine.outputs import Request
from batchjob.engine.sampling_params import SamplingParams
from batchjob.job.contracts import Embedder, JobEngine
from batchjob.job.input.images import ImageReader, RowImages
from batchjob.job.input.lora import RowLora
from batchjob.job.input.prompt import PromptBuilder, RowError
from batchjob.job.input.reader import Row
from batchjob.job.spec import JobSpec

# Quarter-octave length bins: lengths within ~19% of each other count as similar.
BINS_PER_OCTAVE = 4
TOKENIZE_CHUNK = 4096  # rows tokenized in one batch call


@dataclass
class Work:
    request_id: str
    token_ids: list[int]
    params: SamplingParams
    truncated: bool
    rows: list[Row] = field(default_factory=list)  # the first is computed, the rest are its duplicates
    lora: str | None = None  # the LoRA adapter the rows name (input/lora.py); None: the base model
    images: RowImages | None = None  # the rows' images (input/images.py), their tokens spliced into token_ids

    @property
    def request(self) -> Request:
        """The engine's request; a row's images are read here, as the stream pulls it (RowError where one fails)."""
        images = self.images.prompt(self.token_ids) if self.images is not None else None
        return Request(self.request_id, self.token_ids, self.params, lora=self.lora, images=images)


@dataclass
class EmbeddingWork:
    row: Row
    inputs: list[list[int]]  # token ids of each of the row's inputs (an OpenAI Batch line may have several)
    truncated: bool
    dimensions: int | None = None  # an OpenAI Batch line's `dimensions`: each embedding cut to its first ones

    @property
    def prompt_tokens(self) -> int:
        return sum(map(len, self.inputs))


class EmbeddingPlanner:
    """Rows to the token ids an Embedder reads: the template filled with the row's columns as plain text, or an
    OpenAI Batch line's inputs (texts or token ids); each cut to the model's max_seq_length as prompt.on_too_long
    says. Rows stay in input order: the Embedder sorts the inputs of each call by length itself."""

    def __init__(self, job: JobSpec, embedder: Embedder, on_error: Callable[[Row, str], None]):
        self.builder = PromptBuilder(job, None, 0)
        self.embedder, self.on_error, self.policy = embedder, on_error, job.prompt.on_too_long
        self.side = "left" if self.policy == "truncate_left" else "right"

    def works(self, rows: Iterable[Row]) -> Iterator[EmbeddingWork]:
        rows = iter(rows)
        while chunk := list(itertools.islice(rows, TOKENIZE_CHUNK)):
            inputs: list[list[str | list[int]] | RowError] = []
            for row in chunk:
                try:
                    if row.error is not None:
                        raise RowError(row.error)
                    inputs.append(row.values["input"] if "input" in row.values else [self.builder.text(row)])
                except RowError as e:
                    inputs.append(e)
            texts = [t for one in inputs if not isinstance(one, RowError) for t in one if isinstance(t, str)]
            tokenized = iter(self.embedder.tokenize(texts, self.side))
            for row, one in zip(chunk, inputs):
                try:
                    if isinstance(one, RowError):
                        raise one
                    texts_of_row = [next(tokenized) for t in one if isinstance(t, str)]
                    yield self._work(row, one, iter((t.token_ids, t.truncated) for t in texts_of_row))
                except RowError as e:
                    self.on_error(row, str(e))

    def _work(
        self, row: Row, inputs: list[str | list[int]], tokenized: Iterator[tuple[list[int], bool]]
    ) -> EmbeddingWork:
        limit, out, truncated = self.embedder.max_seq_length, [], False
        for i, one in enumerate(inputs):
            ids, cut = next(tokenized) if isinstance(one, str) else self._token_ids(one, i)
            if cut and self.policy == "error":
                raise RowError(
                    f"input{f'[{i}]' if len(inputs) > 1 else ''} is longer than the model's max_seq_length of "
                    f"{limit} tokens (prompt.on_too_long: error)"
                )
            out.append(ids)
            truncated |= cut
        dimensions = row.values.get("dimensions")
        if dimensions is not None and not self.embedder.can_shorten_to(dimensions):
            raise RowError(
                f"body.dimensions {dimensions}: this model's embeddings have {self.embedder.dimension} and it "
                "cannot give fewer (not a Matryoshka model)"
                if dimensions < self.embedder.dimension
                else f"body.dimensions {dimensions}: this model's embeddings have {self.embedder.dimension}"
            )
        return EmbeddingWork(row, out, truncated, dimensions)

    def _token_ids(self, ids: list[int], i: int) -> tuple[list[int], bool]:
        vocab = self.embedder.vocab_size
        if any(t >= vocab for t in ids):
            raise RowError(f"input[{i}]: a token id outside the vocabulary (0 to {vocab - 1})")
        limit = self.embedder.max_seq_length
        if len(ids) <= limit:
            return ids, False
        return (ids[-limit:] if self.side == "left" else ids[:limit]), True


def job_planner(
    job: JobSpec,
    engine: JobEngine,
    on_error: Callable[[Row, str], None],
    on_note: Callable[[str], None] = lambda note: None,
) -> Planner:
    """The job's planner for this engine's tokenizer, context and block size; JobFileError at once when the job's
    chat messages need a chat template that the model lacks; `on_note` hears how prompts are built where the job
    file leaves it to the model (a base model's plain-text prompts)."""
    chats = job.input.messages_column is not None or job.input.format == "openai-batch"
    vision = engine.image_prompter is not None and job.executor == "local"
    # the image column's, or on a vision-language model the image parts of chat rows
    images = ImageReader(job, engine) if job.input.image_column is not None or (chats and vision) else None
    builder = PromptBuilder(
        job, engine.tokenizer, engine.max_model_len, images and images.token, _no_images(job, engine)
    )
    if note := builder.check():
        on_note(note)
    return Planner(
        builder,
        job.sampling,
        sort_window=job.schedule.sort_window,
        dedupe=job.schedule.dedupe,
        block_size=engine.config.block_size,
        on_error=on_error,
        lora=RowLora(job),
        images=images,
        context_len=engine.max_model_len,
    )


def _no_images(job: JobSpec, engine: JobEngine) -> str:
    """Why an image part fails its row where this job reads no images, after "... is an image" (row data never stops
    a job; an image column, which the job file names, does on a text-only model)."""
    if engine.image_prompter is None:
        return f", and model {job.model} takes no images (it is not a vision-language model)"
    return f": executor {job.executor!r} reads no images yet"


def requests(
    works: Iterable[Work], in_flight: dict[str, Work], on_error: Callable[[Row, str], None] | None = None
) -> Iterator[Request]:
    """Each work's request, keeping the work in `in_flight` under its id until the caller pops it with the output;
    a work whose image no longer reads goes to `on_error`, each of its rows."""
    for work in works:
        try:
            request = work.request
        except RowError as e:
            for row in work.rows:
                on_error(row, str(e))
            continue
        in_flight[work.request_id] = work
        yield request


class Planner:
    def __init__(
        self,
        builder: PromptBuilder,
        params: SamplingParams,
        *,
        sort_window: int,
        dedupe: bool,
        block_size: int,
        on_error: Callable[[Row, str], None],
        lora: RowLora,
        images: ImageReader | None = None,
        context_len: int = 0,
    ):
        self.builder, self.params, self.lora = builder, params, lora
        self.images, self.context_len = images, context_len
        self.sort_window, self.dedupe, self.block_size = sort_window, dedupe, block_size
        self.on_error = on_error
        self._ids = itertools.count()
        self._params_json = params.model_dump_json().encode()

    def works(self, rows: Iterable[Row]) -> Iterator[Work]:
        return in_windows(self._works(rows), self._request_key, self.sort_window, self.block_size)

    def _request_key(self, work: Work) -> bytes | None:
        if not self.dedupe or not work.params.deterministic:
            return None
        # Most rows share the job's SamplingParams object, whose JSON is made once.
        same = work.params is self.params
        return _request_key(work, self._params_json if same else work.params.model_dump_json().encode())

    def _works(self, rows: Iterable[Row]) -> Iterator[Work]:
        """Rows to Works in input order, tokenized a chunk at a time; failing rows go to on_error, in order too."""
        rows = iter(rows)
        while chunk := list(itertools.islice(rows, TOKENIZE_CHUNK)):
            results: list[RowError | SamplingParams] = []
            loras: list[str | None] = []
            for row in chunk:
                try:
                    if row.error is not None:
                        raise RowError(row.error)
                    lora, params = self.lora.of(row), self._row_params(row)
                except RowError as e:
                    lora, params = None, e
                loras.append(lora)
                results.append(params)
            usable = [i for i, r in enumerate(results) if isinstance(r, SamplingParams)]
            built = self.builder.build_many([chunk[i] for i in usable], [results[i].max_tokens for i in usable])
            prompts = dict(zip(usable, built))
            for i, row in enumerate(chunk):
                result = prompts.get(i, results[i])
                images = None
                if self.images is not None and not isinstance(result, RowError):
                    try:
                        ids, images = self._with_images(row, result[0])
                        result = (ids, result[1])
                    except RowError as e:
                        result = e
                if isinstance(result, RowError):
                    self.on_error(row, str(result))
                else:
                    yield Work(str(next(self._ids)), result[0], results[i], result[1], [row], loras[i], images)

    def _with_images(self, row: Row, token_ids: list[int]) -> tuple[list[int], RowImages | None]:
        """The prompt with the row's images spliced in; RowError where one does not read, or the prompt with them no
        longer fits the context (prompt.on_too_long cut the prompt before the images' tokens were known)."""
        ids, images = self.images.splice(row, token_ids)
        if images is not None and len(ids) >= self.context_len:
            raise RowError(
                f"the prompt with its images is {len(ids)} tokens ({images.tokens} of them the images'), too long "
                f"for the model's context of {self.context_len}"
            )
        return ids, images

    def _row_params(self, row: Row) -> SamplingParams:
        if not row.overrides:
            return self.params
        try:
            return self.params.with_overrides(row.overrides)
        except pydantic.ValidationError as e:
            raise RowError("; ".join(_describe(err) for err in e.errors())) from None


def _describe(err: dict) -> str:
    message = err["msg"].removeprefix("Value error, ")
    return f"{'.'.join(map(str, err['loc']))}: {message}" if err["loc"] else message


class Planned(Protocol):
    """What in_windows orders: a planner's work, for one or more rows."""

    token_ids: list[int]
    rows: list[Row]


W = TypeVar("W", bound=Planned)


def in_windows(works: Iterable[W], key: Callable[[W], bytes | None], sort_window: int, block_size: int) -> Iterator[W]:
    """`works` (one row each) a window of `sort_window` rows at a time, ordered (order()); a work whose key (not None)
    an earlier one of its window has is computed once, its row joining that work's rows."""
    window: list[W] = []
    by_key: dict[bytes, W] = {}
    size = 0
    for work in works:
        k = key(work)
        if k is not None and k in by_key:
            by_key[k].rows.append(work.rows[0])
        else:
            window.append(work)
            if k is not None:
                by_key[k] = work
        size += 1
        if size >= sort_window:
            yield from order(window, block_size)
            window, by_key, size = [], {}, 0
    yield from order(window, block_size)


def order(works: list[W], block_size: int) -> list[W]:
    works.sort(key=lambda w: w.token_ids)
    runs: list[list[W]] = []
    for work in works:
        if runs and _share_a_block(runs[-1][-1].token_ids, work.token_ids, block_size):
            runs[-1].append(work)
        else:
            runs.append([work])
    ordered = [w for run in runs if len(run) > 1 for w in sorted(run, key=_length_bin)]
    return ordered + sorted((run[0] for run in runs if len(run) == 1), key=_length_bin)


def _share_a_block(a: list[int], b: list[int], block_size: int) -> bool:
    return len(a) >= block_size and len(b) >= block_size and a[:block_size] == b[:block_size]


def _length_bin(work: Planned) -> int:
    return int(BINS_PER_OCTAVE * math.log2(max(1, len(work.token_ids))))


def _request_key(work: Work, params_json: bytes) -> bytes:
    digest = hashlib.blake2b(array("q", work.token_ids).tobytes(), digest_size=16)
    digest.update(params_json)
    digest.update(b"\0lora:" + (work.lora or "").encode())  # rows of different adapters are different requests
    # an image's tokens are placeholders, the same for any image of its size: each image's pixels key it, in order
    for image in work.images.digests if work.images is not None else ():
        digest.update(b"\0image:" + image)
    return digest.digest()
