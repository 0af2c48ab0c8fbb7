"""A scoring job's rows (task: score) to engine requests and back: each row's prompt, then what is scored after it
(nothing more for the text's own tokens, its continuation column's text, or each label), as prompt-only requests
(max_tokens 0, prompt_logprobs) that the engine packs and chunks like any prefill; a row's outputs back together into
its engine ScoreOutput (Engine.score's, built by the same score_output)."""

from __future__ import annotations

import functools
import hashlib
import itertools
from array import array
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from batchjob.engine.outputs import Request, RequestOutput, ScoreOutput, row_requests, score_output
from batchjob.engine.sampling_params import SamplingParams
from batchjob.job.contracts import JobEngine
from batchjob.job.input.lora import RowLora
from batchjob.job.input.planner import TOKENIZE_CHUNK, in_windows
from batchjob.job.input.prompt import PromptBuilder, RowError, cell_text, shown
from batchjob.job.input.reader import Row
from batchjob.job.spec import JobFileError, JobSpec


@dataclass
class ScoreWork:
    request_id: str
    token_ids: list[int]  # the prompt's
    # What follows the prompt in each of the work's requests: [[]] for the prompt's own tokens, [the continuation's],
    # or each label's, in the labels' order.
    tails: list[list[int]]
    start: int  # the first scored token of each request: 1, or the first after the prompt
    params: SamplingParams  # max_tokens 0 and prompt_logprobs
    labels: list[str] | None
    truncated: bool
    rows: list[Row] = field(default_factory=list)  # the first is computed, the rest are its duplicates
    lora: str | None = None  # the LoRA adapter the rows name (input/lora.py); None: the base model

    def requests(self) -> list[Request]:
        """The engine's requests for the work (row_requests): with labels, one prefill of the prompt for them all."""
        labels = self.labels is not None
        return row_requests(self.request_id, self.token_ids, self.tails, self.start, self.params, labels, self.lora)

    def score(self, outputs: list[RequestOutput]) -> ScoreOutput:
        """The ScoreOutput of the work's finished requests, in their order."""
        return score_output(self.request_id, outputs, self.start, self.labels)

    @property
    def scored_tokens(self) -> int:
        return sum(len(self.token_ids) + len(tail) - self.start for tail in self.tails)

    @functools.cached_property
    def num_requests(self) -> int:
        return len(self.requests())

    @property
    def total_tokens(self) -> int:
        """Of all its requests."""
        return sum(len(r.prompt_token_ids) for r in self.requests())


class ScorePlanner:
    """Rows to ScoreWorks: the prompt built as for generation (template, system text, chat template if asked for, the
    too-long policy leaving room for what is scored after it), the continuation tokenized on its own as row data
    (never special tokens, unless prompt.special_tokens_in_data), identical works computed once and a window of rows
    ordered at a time (planner.in_windows), as the generation planner does."""

    def __init__(self, job: JobSpec, engine: JobEngine, on_error: Callable[[Row, str], None]):
        self.builder = PromptBuilder(job, engine.tokenizer, engine.max_model_len)
        self.tokenizer, self.on_error = engine.tokenizer, on_error
        spec = job.score
        self.column, self.labels = spec.continuation_column, spec.labels
        # Labels are the job file's text, as its template is: read as written.
        self.label_ids = [
            self.tokenizer.encode(self.builder.text_of_job(label), add_special_tokens=False)
            for label in spec.labels or []
        ]
        for label, ids in zip(spec.labels or [], self.label_ids):
            # A setting of the job file, not of a row: every row would fail on it, so the job is refused at once.
            if len(ids) >= engine.max_model_len:
                raise JobFileError(
                    f"score.labels: the label {shown(label)!r} is {len(ids)} tokens, not under the model's context of "
                    f"{engine.max_model_len} (engine.max_model_len): no prompt fits before it"
                )
        self.params = SamplingParams(max_tokens=0, prompt_logprobs=spec.prompt_logprobs or 0)
        self.sort_window, self.dedupe = job.schedule.sort_window, job.schedule.dedupe
        self.block_size = engine.config.block_size
        self.lora = RowLora(job)
        self._ids = itertools.count()

    def works(self, rows: Iterable[Row]) -> Iterator[ScoreWork]:
        key = _work_key if self.dedupe else lambda work: None  # scoring is deterministic: any two alike are one
        return in_windows(self._works(rows), key, self.sort_window, self.block_size)

    def _works(self, rows: Iterable[Row]) -> Iterator[ScoreWork]:
        """Rows to works in input order, a chunk at a time; failing rows go to on_error, in order too."""
        rows = iter(rows)
        while chunk := list(itertools.islice(rows, TOKENIZE_CHUNK)):
            tails: list[list[list[int]] | RowError] = []
            texts: list[str] = []
            loras: list[str | None] = []
            for row in chunk:
                loras.append(None)
                try:
                    if row.error is not None:
                        raise RowError(row.error)
                    loras[-1] = self.lora.of(row)
                    if self.column is not None:
                        texts.append(self.builder.data(_continuation(row.values.get(self.column), self.column)))
                    tails.append(self.label_ids or [[]])
                except RowError as e:
                    tails.append(e)
            continuations = iter(self.tokenizer.encode_batch(texts, add_special_tokens=False))
            if self.column is not None:
                tails = [t if isinstance(t, RowError) else [next(continuations)] for t in tails]
            usable = [i for i, t in enumerate(tails) if not isinstance(t, RowError)]
            rooms = [max(map(len, tails[i])) for i in usable]
            built = dict(zip(usable, self.builder.build_many([chunk[i] for i in usable], rooms)))
            for i, row in enumerate(chunk):
                prompt = built.get(i, tails[i])
                if isinstance(prompt, RowError):
                    self.on_error(row, str(prompt))
                    continue
                ids, truncated = prompt
                start = 1 if self.column is None and self.labels is None else len(ids)
                work_id = str(next(self._ids))
                yield ScoreWork(work_id, ids, tails[i], start, self.params, self.labels, truncated, [row], loras[i])


def score_planner(
    job: JobSpec,
    engine: JobEngine,
    on_error: Callable[[Row, str], None],
    on_note: Callable[[str], None] = lambda note: None,
) -> ScorePlanner:
    """The job's ScorePlanner; as planner.job_planner, JobFileError at once when chat messages need a chat template
    the model lacks or a label fills the model's context, and `on_note` hears how prompts are built where the job
    file leaves it to the model."""
    planner = ScorePlanner(job, engine, on_error)
    if note := planner.builder.check():
        on_note(note)
    return planner


def score_requests(works: Iterable[ScoreWork], in_flight: dict[str, ScoreWork]) -> Iterator[Request]:
    """Each work's requests, keeping the work in `in_flight` under each request's id until the caller pops it with
    that request's output."""
    for work in works:
        for request in work.requests():
            in_flight[request.request_id] = work
            yield request


class ScoreGather:
    """The outputs of each work's requests, held until the work has them all."""

    def __init__(self):
        self.got: dict[str, dict[int, RequestOutput]] = {}

    def add(self, work: ScoreWork, output: RequestOutput) -> list[RequestOutput] | None:
        """The work's outputs once `output` completes them; None before."""
        got = self.got.setdefault(work.request_id, {})
        got[output.request_id] = output
        if len(got) < work.num_requests:
            return None
        del self.got[work.request_id]
        return list(got.values())


def cached_tokens(outputs: list[RequestOutput]) -> int:
    return sum(o.num_cached_tokens for o in outputs)


def _continuation(value, name: str) -> str:
    """A row's continuation text; RowError where there is none. Unlike a prompt, blank text (a space) is text to
    score."""
    value = cell_text(value, name, "continuation")
    if not value:
        raise RowError(f"missing continuation: {name} is empty (nothing to score)")
    return value


def _work_key(work: ScoreWork) -> bytes:
    digest = hashlib.blake2b(digest_size=16)
    for ids in (work.token_ids, *work.tails):  # each with its length: no two different splits hash alike
        digest.update(len(ids).to_bytes(8, "little"))
        digest.update(array("q", ids).tobytes())
    digest.update(b"lora:" + (work.lora or "").encode())  # rows of different adapters are different works
    return digest.digest()
