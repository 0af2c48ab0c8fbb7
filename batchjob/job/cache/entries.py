"""A results-cache entry's result, both ways: what the engine's output is stored as, and the output an entry gives the
work that looks it up.

An entry is read as untrusted input: a shared cache is written by other jobs, other versions of batchjob and people,
and its checksum says only that the entry is whole, not that it is a result. So an entry gives a work its result
only if it is exactly the shape of the result that work asks for: every field of its type, every list of the length
the work's settings make (its n samples, its top logprobs, the model's dimension), every token id of the work's own
tokens where the entry repeats them. Anything else is `Unfit`, which the cache takes for a miss: the row is computed
again, never written from a value its output's columns cannot hold (that failed the whole run at its next
checkpoint, on every run, until someone deleted the entry by hand)."""

from __future__ import annotations

import reprlib
from typing import Any

from batchjob.engine.outputs import CompletionOutput, RequestOutput, ScoreOutput, TokenLogprob
from batchjob.job.input.planner import EmbeddingWork, Work
from batchjob.job.input.scoring import ScoreWork

# The finish reasons of a stored result: RunCache.store keeps no error, abort or length_capped output.
STORED_REASONS = ("stop", "length")
MAX_TOKEN_ID = 2**31 - 1  # the output's token_id columns are int32


class Unfit(ValueError):
    """An entry that is no result for the work that looked it up; the message says where it is not."""


def generation_entry(output: RequestOutput) -> dict:
    prompt = output.prompt_logprobs
    return {
        "text": output.text,
        "finish_reason": output.finish_reason,
        # with sampling's prompt_logprobs: per prompt token [id, logprob, top, rank], null for the first
        "prompt_logprobs": None
        if prompt is None
        else [lp and [lp.token_id, lp.logprob, lp.top, lp.rank] for lp in prompt],
        "samples": [
            {
                "text": s.text,
                "token_ids": s.token_ids,
                "finish_reason": s.finish_reason,
                "logprobs": None if s.logprobs is None else [[lp.token_id, lp.logprob, lp.top] for lp in s.logprobs],
            }
            for s in output.samples
        ],
    }


def generation_result(entry: Any, work: Work) -> RequestOutput:
    """The RequestOutput an entry stores, for `work`'s request: its n samples, each token's logprobs where the work
    asks for them (its top_logprobs each), the prompt's where it asks for those. The top-level text and finish
    reason are the first sample's, as the engine gives them."""
    params = work.params
    samples = []
    for i, sample in enumerate(_list(_get(entry, "samples", "the result"), "samples", params.n)):
        where = f"samples[{i}]"
        token_ids = _token_ids(_get(sample, "token_ids", where), f"{where}.token_ids")
        logprobs = None
        if params.logprobs:
            stored = _list(_get(sample, "logprobs", where), f"{where}.logprobs", len(token_ids))
            logprobs = [
                _token_logprob(lp, f"{where}.logprobs[{j}]", t, params.top_logprobs)
                for j, (lp, t) in enumerate(zip(stored, token_ids))
            ]
        text = _str(_get(sample, "text", where), f"{where}.text")
        reason = _reason(_get(sample, "finish_reason", where), f"{where}.finish_reason")
        samples.append(CompletionOutput(i, text, token_ids, reason, logprobs))
    prompt = None
    if params.prompt_logprobs is not None:
        prompt = _prompt_logprobs(_get(entry, "prompt_logprobs", "the result"), work.token_ids, params.prompt_logprobs)
    first = samples[0]
    # the whole prompt counts as cached, as for a duplicate row: nothing of it was computed
    return RequestOutput(
        work.request_id,
        work.token_ids,
        first.token_ids,
        first.text,
        first.finish_reason,
        num_cached_tokens=len(work.token_ids),
        logprobs=first.logprobs,
        outputs=samples,
        prompt_logprobs=prompt,
    )


def _prompt_logprobs(stored: Any, token_ids: list[int], k: int) -> list[TokenLogprob | None]:
    """One per prompt token, each of that token with its k top and its rank; none for the first (nothing before it)."""
    stored = _list(stored, "prompt_logprobs", len(token_ids))
    if stored[0] is not None:
        raise Unfit("prompt_logprobs[0]: the first prompt token has no logprob")
    return [None] + [
        _token_logprob(lp, f"prompt_logprobs[{j}]", t, k, rank=True)
        for j, (lp, t) in enumerate(zip(stored[1:], token_ids[1:]), 1)
    ]


def score_entry(score: ScoreOutput) -> dict:
    lps = score.token_logprobs
    return {
        "num_scored_tokens": score.num_scored_tokens,
        "token_logprobs": None if lps is None else [[lp.token_id, lp.logprob, lp.top] for lp in lps],
        "sum_nll": score.sum_nll,
        "mean_nll": score.mean_nll,
        "perplexity": score.perplexity,
        "label_logprobs": score.label_logprobs,
        "label": score.label,
        "label_probs": score.label_probs,
    }


def score_result(entry: Any, work: ScoreWork) -> ScoreOutput:
    """The ScoreOutput an entry stores, for `work`: a classification's logprob and probability of each of its labels
    and the likeliest label; or each scored token's logprob (of the work's tokens from `start` on, with its top) and
    the NLL over them."""
    if work.labels is not None:
        n = len(work.labels)
        label_logprobs = _floats(_get(entry, "label_logprobs", "the result"), "label_logprobs", n)
        label_probs = _floats(_get(entry, "label_probs", "the result"), "label_probs", n)
        label = _get(entry, "label", "the result")
        likeliest = work.labels[label_logprobs.index(max(label_logprobs))]
        if label != likeliest:
            raise Unfit(f"label: {_shown(label)}, not the likeliest of the label logprobs ({likeliest!r})")
        return ScoreOutput(
            work.request_id,
            work.token_ids,
            labels=work.labels,
            label_logprobs=label_logprobs,
            label=label,
            label_probs=label_probs,
            finish_reason="length",
        )
    scored = (work.token_ids + work.tails[0])[work.start :]
    num = _get(entry, "num_scored_tokens", "the result")
    if num != len(scored) or isinstance(num, bool):
        raise Unfit(f"num_scored_tokens: {_shown(num)}, not the work's {len(scored)}")
    stored = _list(_get(entry, "token_logprobs", "the result"), "token_logprobs", len(scored))
    k = work.params.prompt_logprobs or 0
    token_logprobs = [_token_logprob(lp, f"token_logprobs[{j}]", t, k) for j, (lp, t) in enumerate(zip(stored, scored))]
    nll = {name: _float(_get(entry, name, "the result"), name) for name in ("sum_nll", "mean_nll", "perplexity")}
    return ScoreOutput(
        work.request_id,
        work.token_ids,
        num_scored_tokens=len(scored),
        token_logprobs=token_logprobs,
        **nll,
        finish_reason="length",
    )


def embedding_result(entry: Any, work: EmbeddingWork, dimension: int) -> list[list[float]]:
    """The vectors an entry stores, for `work`: one per input, each of the model's `dimension` floats."""
    vectors = _list(entry, "the result", len(work.inputs))
    return [_floats(v, f"[{i}]", dimension) for i, v in enumerate(vectors)]


def _get(entry: Any, key: str, where: str) -> Any:
    if not isinstance(entry, dict):
        raise Unfit(f"{where}: {_shown(entry)}, not an object")
    if key not in entry:
        raise Unfit(f"{where}: no {key!r}")
    return entry[key]


def _list(value: Any, where: str, length: int | None = None) -> list:
    if not isinstance(value, list):
        raise Unfit(f"{where}: {_shown(value)}, not a list")
    if length is not None and len(value) != length:
        raise Unfit(f"{where}: {len(value)} items, not {length}")
    return value


def _str(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise Unfit(f"{where}: {_shown(value)}, not a string")
    return value


def _reason(value: Any, where: str) -> str:
    if value not in STORED_REASONS or not isinstance(value, str):
        raise Unfit(f"{where}: {_shown(value)}, not one of {', '.join(STORED_REASONS)}")
    return value


def _int(value: Any, where: str, low: int, high: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise Unfit(f"{where}: {_shown(value)}, not an integer from {low} to {high}")
    return value


def _token_id(value: Any, where: str) -> int:
    return _int(value, where, 0, MAX_TOKEN_ID)


def _token_ids(value: Any, where: str) -> list[int]:
    ids = _list(value, where)
    if not all(type(t) is int and 0 <= t <= MAX_TOKEN_ID for t in ids):  # the common case at a list's speed
        for j, t in enumerate(ids):
            _token_id(t, f"{where}[{j}]")
    return ids


def _float(value: Any, where: str) -> float:
    """A number (JSON writes a whole float as 1.0; an integer stands for the same float)."""
    if not isinstance(value, (float, int)) or isinstance(value, bool):
        raise Unfit(f"{where}: {_shown(value)}, not a number")
    return float(value)


def _floats(value: Any, where: str, length: int) -> list[float]:
    numbers = _list(value, where, length)
    if not all(type(x) is float for x in numbers):  # the common case (a vector) at a list's speed
        numbers = [_float(x, f"{where}[{i}]") for i, x in enumerate(numbers)]
    return numbers


def _token_logprob(value: Any, where: str, token_id: int, k: int, rank: bool = False) -> TokenLogprob:
    """[id, logprob, top] (and rank, with `rank`) of the token `token_id`, with its k likeliest (id, logprob)."""
    parts = _list(value, where, 4 if rank else 3)
    if parts[0] != token_id or isinstance(parts[0], bool):
        raise Unfit(f"{where}[0]: {_shown(parts[0])}, not the work's token {token_id}")
    top = []
    for i, pair in enumerate(_list(parts[2], f"{where}[2]", k)):
        at = f"{where}[2][{i}]"
        pair = _list(pair, at, 2)
        top.append((_token_id(pair[0], f"{at}[0]"), _float(pair[1], f"{at}[1]")))
    lp = _float(parts[1], f"{where}[1]")
    return TokenLogprob(token_id, lp, top, _int(parts[3], f"{where}[3]", 1, MAX_TOKEN_ID) if rank else None)


def _shown(value: Any) -> str:
    """A value as an error message names it: its type, and the value cut short."""
    return f"{type(value).__name__} {reprlib.repr(value)}"
