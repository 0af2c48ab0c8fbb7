"""A results-cache entry is untrusted input (a shared cache is written by other jobs and people): an entry whose
checksum fits but whose result is not the shape its work asks for is a miss, said once with its key, never a row.
Each kind of entry (a generation's, a score's of a text or of labels, an embedding's) is stored whole and read back
equal, then each of its fields is made wrong in the ways a writer could: another type, another length, token ids that
are not the work's or that the output's columns cannot hold."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from batchjob.engine.outputs import CompletionOutput, RequestOutput, ScoreOutput, TokenLogprob
from batchjob.engine.sampling_params import SamplingParams
from batchjob.job.cache.results_cache import ResultsCache, RunCache
from batchjob.job.input.planner import EmbeddingWork, Work
from batchjob.job.input.scoring import ScoreWork
from batchjob.job.spec import CacheSpec
from tests.fakes import FakeEngine
from tests.helpers import Messages, make_job

DIMENSION = 8
GENERATION = SamplingParams(
    n=2, temperature=0.7, seed=1, max_tokens=3, logprobs=True, top_logprobs=2, prompt_logprobs=1
)


def generation() -> tuple[Work, RequestOutput]:
    """Two samples with their tokens' logprobs (two top each), and the prompt's (one top each, and the rank)."""
    first = [TokenLogprob(8, -0.5, [(8, -0.5), (3, -1.0)]), TokenLogprob(9, -0.25, [(9, -0.25), (4, -2.0)])]
    samples = [
        CompletionOutput(0, "ab", [8, 9], "stop", first),
        CompletionOutput(1, "c", [10], "length", [TokenLogprob(10, -1.5, [(11, -0.5), (10, -1.5)])]),
    ]
    prompt = [None, TokenLogprob(6, -2.0, [(1, -0.125)], 3), TokenLogprob(7, -1.0, [(7, -1.0)], 1)]
    output = RequestOutput(
        "0", [5, 6, 7], [8, 9], "ab", "stop", logprobs=first, outputs=samples, prompt_logprobs=prompt
    )
    return Work("0", [5, 6, 7], GENERATION, False), output


def text_score() -> tuple[ScoreWork, ScoreOutput]:
    """A text scored from its second token on, with two top logprobs a token."""
    params = SamplingParams(max_tokens=0, prompt_logprobs=2)
    work = ScoreWork("0", [5, 6, 7], [[]], 1, params, None, False)
    lps = [TokenLogprob(6, -1.0, [(6, -1.0), (2, -1.5)]), TokenLogprob(7, -0.5, [(7, -0.5), (1, -3.0)])]
    return work, ScoreOutput("0", [5, 6, 7], 2, lps, 1.5, 0.75, 2.117000016612675, finish_reason="length")


def label_score() -> tuple[ScoreWork, ScoreOutput]:
    labels = [" yes", " no", " maybe"]
    work = ScoreWork(
        "0", [5, 6], [[7], [8, 9], [10]], 2, SamplingParams(max_tokens=0, prompt_logprobs=0), labels, False
    )
    score = ScoreOutput(
        "0",
        [5, 6],
        labels=labels,
        label_logprobs=[-2.0, -0.5, -3.0],
        label=" no",
        label_probs=[0.17, 0.77, 0.06],
        finish_reason="length",
    )
    return work, score


def embedding() -> tuple[EmbeddingWork, list[list[float]]]:
    """A line of two inputs: two vectors of the model's dimension."""
    vectors = [[0.25 * i - 1.0 for i in range(DIMENSION)], [1.0 / (i + 1) for i in range(DIMENSION)]]
    return EmbeddingWork(None, [[1, 2], [3]], False), vectors


KINDS = {"generation": generation, "text score": text_score, "label score": label_score, "embedding": embedding}


def run_cache(folder: Path, kind: str, messages: Messages | None = None) -> RunCache:
    task = {"generation": "generate", "embedding": "embed"}.get(kind, "score")
    sections = {} if task == "generate" else {"sampling": None}
    job = make_job(folder / "in.parquet", folder / "out", task=task, **sections)
    engine = FakeEngine()
    if task == "embed":
        engine = SimpleNamespace(model_digest="d", model_revision=None, numerics=engine.numerics, dimension=DIMENSION)
    return RunCache(ResultsCache(CacheSpec(path=str(folder / "cache")), (messages or Messages()).message), job, engine)


def look_up(cache: RunCache, kind: str, work) -> object | None:
    """What a run's lookup of `work` gives: its result, or None for a miss (whose key the cache then keeps)."""
    hits = []
    misses = {
        "generation": cache.generation_misses,
        "embedding": cache.embedding_misses,
    }.get(kind, cache.score_misses)
    list(misses([work], lambda work, result: hits.append(result)))
    return hits[0] if hits else None


def store(cache: RunCache, kind: str, work, result) -> None:
    assert look_up(cache, kind, work) is None
    {"generation": cache.store, "embedding": cache.store_embeddings}.get(kind, cache.store_score)(work, result)


def entry_of(folder: Path) -> tuple[str, dict]:
    (path,) = (folder / "cache").rglob("*.json")
    entry = json.loads(path.read_text())
    return entry["key"], entry["result"]


@pytest.mark.parametrize("kind", KINDS)
def test_each_kind_of_entry_reads_back_as_the_result_it_stores(tmp_path, kind):
    work, result = KINDS[kind]()
    store(run_cache(tmp_path, kind), kind, work, result)
    got = look_up(run_cache(tmp_path, kind), kind, work)
    if kind == "generation":
        assert (got.outputs, got.prompt_logprobs) == (result.outputs, result.prompt_logprobs)
        assert (got.text, got.finish_reason, got.token_ids, got.logprobs) == ("ab", "stop", [8, 9], result.logprobs)
    else:
        assert got == result


def set_at(path: str, value) -> Callable[[Any], Any]:
    """A change to an entry's result: the value at a dotted path (list indexes as numbers) replaced, or deleted."""

    def change(entry):
        *head, last = [int(p) if p.isdigit() else p for p in path.split(".")]
        inner = entry
        for part in head:
            inner = inner[part]
        if value is DELETE:
            del inner[last]
        else:
            inner[last] = value
        return entry

    return change


def edit(change: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """A change made in place (a list's pop, append): the entry, changed."""
    return lambda entry: (change(entry), entry)[1]


DELETE = object()
UNFIT = {
    "generation": {
        "not an object": lambda e: [1, 2],
        "no samples": set_at("samples", DELETE),
        "samples not a list": set_at("samples", {"0": {}}),
        "fewer samples than n": edit(lambda e: e["samples"].pop()),
        "more samples than n": edit(lambda e: e["samples"].append(copy.deepcopy(e["samples"][0]))),
        "a sample not an object": set_at("samples.1", "c"),
        "text a number": set_at("samples.0.text", 3),
        "text null": set_at("samples.1.text", None),
        "finish_reason a list": set_at("samples.0.finish_reason", ["stop"]),
        "finish_reason null": set_at("samples.1.finish_reason", None),
        "finish_reason abort": set_at("samples.0.finish_reason", "abort"),
        "finish_reason length_capped": set_at("samples.0.finish_reason", "length_capped"),
        "finish_reason unknown": set_at("samples.0.finish_reason", "done"),
        "token_ids a string": set_at("samples.0.token_ids", "89"),
        "a token id a string": set_at("samples.0.token_ids.1", "9"),
        "a token id a float": set_at("samples.0.token_ids.1", 9.5),
        "a token id true": set_at("samples.0.token_ids.1", True),
        "a token id negative": set_at("samples.0.token_ids.0", -1),
        "a token id past int32": set_at("samples.1.token_ids.0", 2**31),
        "logprobs null when asked": set_at("samples.0.logprobs", None),
        "fewer logprobs than tokens": edit(lambda e: e["samples"][0]["logprobs"].pop()),
        "a logprob of another token": set_at("samples.0.logprobs.1.0", 4),
        "a logprob a string": set_at("samples.0.logprobs.0.1", "-0.5"),
        "a logprob null": set_at("samples.1.logprobs.0.1", None),
        "a token logprob of two items": edit(lambda e: e["samples"][0]["logprobs"][0].pop()),
        "fewer top logprobs than asked": edit(lambda e: e["samples"][0]["logprobs"][0][2].pop()),
        "more top logprobs than asked": edit(lambda e: e["samples"][0]["logprobs"][0][2].append([1, -9.0])),
        "a top logprob's id a string": set_at("samples.0.logprobs.1.2.0.0", "9"),
        "a top logprob's value a list": set_at("samples.0.logprobs.1.2.1.1", [-2.0]),
        "a top logprob not a pair": set_at("samples.0.logprobs.1.2.1", [4]),
        "no prompt_logprobs when asked": set_at("prompt_logprobs", DELETE),
        "prompt_logprobs null when asked": set_at("prompt_logprobs", None),
        "prompt_logprobs a token short": edit(lambda e: e["prompt_logprobs"].pop()),
        "prompt_logprobs' first not null": set_at("prompt_logprobs.0", [5, -1.0, [[5, -1.0]], 1]),
        "a prompt logprob of another token": set_at("prompt_logprobs.2.0", 6),
        "a prompt logprob's rank a string": set_at("prompt_logprobs.1.3", "3"),
        "a prompt logprob's rank 0": set_at("prompt_logprobs.1.3", 0),
        "a prompt logprob without its rank": edit(lambda e: e["prompt_logprobs"][1].pop()),
        "a prompt logprob's top too long": edit(lambda e: e["prompt_logprobs"][1][2].append([2, -3.0])),
    },
    "text score": {
        "not an object": lambda e: "2.5",
        "sum_nll a string": set_at("sum_nll", "1.5"),
        "mean_nll null": set_at("mean_nll", None),
        "perplexity a list": set_at("perplexity", [2.1]),
        "no perplexity": set_at("perplexity", DELETE),
        "num_scored_tokens a string": set_at("num_scored_tokens", "2"),
        "num_scored_tokens another count": set_at("num_scored_tokens", 3),
        "token_logprobs null": set_at("token_logprobs", None),
        "fewer token logprobs than scored tokens": edit(lambda e: e["token_logprobs"].pop()),
        "fewer token logprobs, num_scored_tokens to match": edit(
            lambda e: e.update(num_scored_tokens=1, token_logprobs=e["token_logprobs"][:1])
        ),
        "a token logprob of another token": set_at("token_logprobs.0.0", 5),
        "a token logprob a string": set_at("token_logprobs.1.1", "x"),
        "fewer top logprobs than asked": edit(lambda e: e["token_logprobs"][1][2].pop()),
    },
    "label score": {
        "label_logprobs a label short": edit(lambda e: e["label_logprobs"].pop()),
        "label_logprobs null": set_at("label_logprobs", None),
        "a label logprob a string": set_at("label_logprobs.0", "-2.0"),
        "label_probs a label long": edit(lambda e: e["label_probs"].append(0.0)),
        "a label prob null": set_at("label_probs.2", None),
        "label not one of the labels": set_at("label", " perhaps"),
        "label not the likeliest": set_at("label", " yes"),
        "label a list": set_at("label", [" no"]),
        "label null": set_at("label", None),
    },
    "embedding": {
        "3 floats for the model's 8": set_at("0", [0.1, 0.2, 0.3]),
        "a float more": edit(lambda e: e[1].append(0.5)),
        "a vector short": edit(lambda e: e.pop()),
        "a vector more": edit(lambda e: e.append(e[0])),
        "a number a string": set_at("1.4", "0.2"),
        "a number null": set_at("0.0", None),
        "a number a list": set_at("0.7", [0.1]),
        "a number true": set_at("0.3", True),
        "not a list": lambda e: {"0": e[0]},
        "a vector an object": set_at("1", {"values": [0.0] * DIMENSION}),
    },
}
CASES = [(kind, name) for kind, changes in UNFIT.items() for name in changes]


@pytest.mark.parametrize("kind, name", CASES, ids=[f"{kind}: {name}" for kind, name in CASES])
def test_an_entry_not_of_its_work_s_result_shape_is_a_miss_said_with_its_key(tmp_path, kind, name):
    work, result = KINDS[kind]()
    store(run_cache(tmp_path, kind), kind, work, result)
    key, stored = entry_of(tmp_path)
    stored = UNFIT[kind][name](stored)
    messages = Messages()
    cache = run_cache(tmp_path, kind, messages)
    cache.cache.put(key, stored)  # written whole, with its right checksum: a writer's, not a damaged disk's
    assert not cache.holds(work)  # `plan` counts it no hit
    assert look_up(cache, kind, work) is None
    assert look_up(cache, kind, work) is None
    said = [m for m in messages.messages if m.startswith("results cache: ")]
    assert len(said) == 1 and f"the entry {key} in " in said[0] and "it is a miss" in said[0], said
    store(run_cache(tmp_path, kind), kind, work, result)  # the row's computed result, stored over it
    assert look_up(run_cache(tmp_path, kind), kind, work) is not None


def test_a_key_keeps_where_token_ids_split():
    """The inputs of an embedding line, a scoring work's prompt and tail, are keyed apart: [[1, 2], [3]] and
    [[1], [2, 3]] are two entries, as is any other split of the same ids."""
    folder = Path("unused")
    embed = run_cache(folder, "embedding")
    keys = [
        embed.work_key(EmbeddingWork(None, inputs, False)) for inputs in ([[1, 2], [3]], [[1], [2, 3]], [[1, 2, 3]])
    ]
    assert len(set(keys)) == 3
    score = run_cache(folder, "text score")
    params = SamplingParams(max_tokens=0, prompt_logprobs=0)
    works = [
        ScoreWork("0", [1, 2], [[3]], 2, params, None, False),
        ScoreWork("0", [1], [[2, 3]], 2, params, None, False),
    ]
    assert len({score.work_key(work) for work in works}) == 2
    generate = run_cache(folder, "generation")
    assert generate.work_key(Work("0", [1, 2, 3], GENERATION, False)) not in keys


@pytest.mark.parametrize("case", ["nested", "surrogate"])
def test_an_entry_json_reads_but_no_writer_could_have_written_is_a_miss(tmp_path, case):
    """json.loads raises RecursionError (no ValueError) on an entry nested deeper than the interpreter's stack: a
    run that read one failed with a traceback. A lone surrogate (JSON's \\ud800 alone) reads as a str that no writer
    can encode: its checksum cannot be taken."""
    work, output = generation()
    store(run_cache(tmp_path, "generation"), "generation", work, output)
    (path,) = (tmp_path / "cache").rglob("*.json")
    if case == "nested":
        path.write_text("[" * 100_000 + "]" * 100_000)
    else:
        entry = json.loads(path.read_text())
        entry["result"]["samples"][0]["text"] = "a\ud800b"
        path.write_text(json.dumps(entry))
    messages = Messages()
    assert look_up(run_cache(tmp_path, "generation", messages), "generation", work) is None
    assert [m for m in messages.messages if "is not a whole entry" in m]
