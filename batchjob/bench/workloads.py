"""The bench's workloads: random token ids as vLLM's benchmark draws them, or a job file's real rows; for
`--task embed`, texts of mixed lengths cut from real documents; for `--task score`, whole documents."""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq

from batchjob.engine.engine import Engine
from batchjob.engine.outputs import Request
from batchjob.engine.sampling_params import SamplingParams
from batchjob.job.input.planner import job_planner
from batchjob.job.input.reader import InputSource


@dataclass
class Workload:
    requests: list[Request]
    name: str

    @property
    def prompt_tokens(self) -> int:
        return sum(len(r.prompt_token_ids) for r in self.requests)


def synthetic(
    vocab_size: int,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
    seed: int = 0,
) -> Workload:
    """As `vllm bench throughput --dataset-name random`: random token ids, lengths uniform in
    [len * (1 - range_ratio), len * (1 + range_ratio)], an optional shared prefix; outputs run to output_len."""
    rng = random.Random(seed)
    draw = lambda n: [rng.randrange(100, vocab_size - 100) for _ in range(n)]  # noqa: E731 - skip special ids
    span = lambda n: rng.randint(max(1, int(n * (1 - range_ratio))), max(1, int(n * (1 + range_ratio))))  # noqa: E731
    prefix = draw(prefix_len)
    reqs = [
        Request(f"r{i}", prefix + draw(span(input_len)), SamplingParams(max_tokens=span(output_len), ignore_eos=True))
        for i in range(num_prompts)
    ]
    name = f"random in={input_len} out={output_len} n={num_prompts} range={range_ratio} prefix={prefix_len}"
    return Workload(reqs, name)


def job_workload(job, engine: Engine, num_rows: int | None = None) -> Workload:
    """A job's first `num_rows` input rows (all by default) as the job runner would send them: its reader, prompt
    builder and planner (order, dedupe, per-row sampling overrides); rows that fail before the model are left out."""
    failed = []
    planner = job_planner(job, engine, lambda row, error: failed.append(row))
    rows = list(itertools.islice(InputSource(job).rows(), num_rows))
    reqs = [w.request for w in planner.works(rows)]
    if not reqs:
        raise ValueError(f"{job.input.path}: none of its first {len(rows)} rows makes a request")
    name = (
        f"job {job.input.path}: {len(rows)} rows, {len(reqs)} requests ({len(failed)} rows fail before the "
        f"model), max_tokens {job.sampling.max_tokens}"
    )
    return Workload(reqs, name)


def unconstrained(wl: Workload, sample_tokens: dict[str, int]) -> Workload:
    """The workload without output constraints, each request held to exactly the tokens its constrained run made
    (its longest sample's; ignore_eos), so that both runs compute the same tokens."""
    free = {"response_format": None, "regex": None, "choice": None, "ignore_eos": True}
    reqs = [
        Request(
            r.request_id,
            r.prompt_token_ids,
            r.params.model_copy(update={**free, "max_tokens": max(1, sample_tokens[r.request_id])}),
        )
        for r in wl.requests
    ]
    return Workload(reqs, f"{wl.name}, unconstrained")


DOCUMENTS = "sample_data/documents.parquet"  # real documents: --task embed's texts are cut from them; --task score's
EMBED_CHARS = (40, 1200)  # the range of text lengths, in characters


def embed_texts(num_texts: int, seed: int = 0, path: str | Path = DOCUMENTS) -> list[str]:
    """`num_texts` texts of EMBED_CHARS characters: each document's text (rows reused in turn) cut at a length drawn
    uniformly from the range, back to the last whitespace at or before it (a word boundary); a text shorter than the
    drawn length is taken whole. Documents shorter than the range's low end are passed over. The same seed gives the
    same texts."""
    lo, hi = EMBED_CHARS
    docs = [t for t in pq.read_table(path, columns=["text"]).column("text").to_pylist() if t and len(t.strip()) >= lo]
    if not docs:
        raise ValueError(f"{path}: no document of {lo} characters or more")
    rng = random.Random(seed)
    texts = []
    for doc in itertools.islice(itertools.cycle(docs), num_texts):
        doc = doc.strip()
        length = rng.randint(lo, hi)
        if len(doc) > length:
            cut = next((i for i in range(length, lo - 1, -1) if doc[i].isspace()), length)
            doc = doc[:cut].rstrip() if len(doc[:cut].rstrip()) >= lo else doc[:cut]
        texts.append(doc)
    return texts


def document_workload(engine: Engine, num_docs: int, path: str | Path = DOCUMENTS) -> Workload:
    """The first `num_docs` documents (fewer where the file has fewer), each its whole text as the engine's tokenizer
    reads it, cut at the model's context (max_model_len): --task score's real rows."""
    docs = [t for t in pq.read_table(path, columns=["text"]).column("text").to_pylist() if t and t.strip()]
    params = SamplingParams(max_tokens=0, prompt_logprobs=0)  # read, not generated: scored teacher-forced
    reqs = [
        Request(f"d{i}", engine.tokenizer.encode(text)[: engine.max_model_len], params)
        for i, text in enumerate(docs[:num_docs])
    ]
    if not reqs:
        raise ValueError(f"{path}: no document with text")
    return Workload(reqs, f"{len(reqs)} documents of {path}")
