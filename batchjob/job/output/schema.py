"""The result dataset's schema: the columns every output row has, and the rows made from a finished request."""

from __future__ import annotations

import functools
from collections.abc import Callable

import pyarrow as pa

TOP_LOGPROB = pa.struct([("token", pa.string()), ("logprob", pa.float64())])
TOKEN_LOGPROB = pa.struct([("token", pa.string()), ("logprob", pa.float64()), ("top_logprobs", pa.list_(TOP_LOGPROB))])
# A prompt token's: TOKEN_LOGPROB's fields with the token ids and the token's rank, which vLLM's prompt_logprobs give
# (keyed by token id). The first prompt token has no logprob (nothing before it): its logprob, rank and top are null.
PROMPT_TOP_LOGPROB = pa.struct([*TOP_LOGPROB, ("token_id", pa.int32())])
PROMPT_LOGPROB = pa.struct(
    [
        *TOKEN_LOGPROB.fields[:2],
        ("top_logprobs", pa.list_(PROMPT_TOP_LOGPROB)),
        ("token_id", pa.int32()),
        ("rank", pa.int32()),
    ]
)
RESULT_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("output", pa.string()),  # the first sample's
        ("finish_reason", pa.string()),
        ("outputs", pa.list_(pa.string())),  # all n samples, with their finish reasons and lengths
        ("finish_reasons", pa.list_(pa.string())),
        ("output_token_counts", pa.list_(pa.int32())),
        ("logprobs", pa.list_(pa.list_(TOKEN_LOGPROB))),  # per sample, per token; with sampling.logprobs
        ("prompt_tokens", pa.int32()),
        ("output_tokens", pa.int32()),  # of all samples, as OpenAI's usage.completion_tokens
        ("cached_tokens", pa.int32()),
        ("truncated", pa.bool_()),
        ("error", pa.string()),
        ("queue_time_s", pa.float64()),
        ("ttft_s", pa.float64()),
        ("total_time_s", pa.float64()),
        ("row_index", pa.int64()),  # the row's position in the input, for `order: input`
    ]
)
RESULT_COLUMNS = frozenset(RESULT_SCHEMA.names)
# An embedding job's rows (task: embed): one `embedding` a row, or for OpenAI Batch input, a line's `embeddings` (one
# per input, each cut to the line's `dimensions`) with the line's encoding_format for its response.
EMBEDDING_COLUMNS = frozenset({"embedding", "embeddings", "encoding_format"})
REASONING_COLUMNS = frozenset({"reasoning", "reasonings"})  # with output.split_reasoning
# With sampling.prompt_logprobs, or OpenAI Batch input (a line's prompt_logprobs, or echo: the prompt the engine read).
PROMPT_COLUMNS = frozenset({"prompt_logprobs", "echo"})
# A scoring job's rows (task: score): the NLL columns of a text or continuation (token_logprobs with
# score.prompt_logprobs), or the label columns of a classification (score.labels).
NLL_SCHEMA = pa.schema(
    [("sum_nll", pa.float64()), ("mean_nll", pa.float64()), ("perplexity", pa.float64())],
)
LABEL_SCHEMA = pa.schema(
    [("label", pa.string()), ("label_logprobs", pa.list_(pa.float64())), ("label_probs", pa.list_(pa.float64()))]
)
SCORE_COLUMNS = frozenset({*NLL_SCHEMA.names, *LABEL_SCHEMA.names, "token_logprobs", "scored_tokens"})
# A part's schema metadata: how many of its rows the results cache gave (hits) and how many it lacked (misses).
CACHE_METADATA = b"batchjob.cache"


THINK_START, THINK_END = "<think>", "</think>"  # the reasoning block of Qwen3, DeepSeek-R1, SmolLM3 and others


def split_reasoning(text: str) -> tuple[str | None, str]:
    """The reasoning and the answer of an output: the text up to `</think>` (less an opening `<think>`) and the text
    after it; an output cut inside its reasoning is all reasoning; an output without the block is all answer. (A
    template that opens the block in the prompt, as DeepSeek-R1's does, leaves only the closing tag in the output.)"""
    head, end, tail = text.partition(THINK_END)
    if end:
        return head.strip().removeprefix(THINK_START).strip(), tail.lstrip()
    if text.lstrip().startswith(THINK_START):
        return text.lstrip().removeprefix(THINK_START).strip(), ""
    return None, text


def result_rows(work, output, tokenizer, reasoning: bool = False) -> list[dict]:
    """The output rows of a finished planner Work: one per input row it stands for, duplicates included; with
    `reasoning`, each sample's reasoning block split off its text."""
    m, samples = output.metrics, output.samples
    token = _token_strings(tokenizer)
    logprobs = prompt_logprobs = None
    if work.params.logprobs:
        logprobs = [[_token_logprob(lp, token) for lp in s.logprobs or []] for s in samples]
    if work.params.prompt_logprobs is not None and output.prompt_logprobs is not None and output.error is None:
        prompt_logprobs = [
            _prompt_logprob(i, lp, token) for i, lp in zip(output.prompt_token_ids, output.prompt_logprobs)
        ]
    echo = None
    if any(row.values.get("echo") for row in work.rows):  # an OpenAI Batch /v1/completions line's echo: true
        echo = tokenizer.decode(work.token_ids, skip_special_tokens=False)
    texts = [s.text for s in samples]
    thoughts = None
    if reasoning:
        thoughts, texts = map(list, zip(*map(split_reasoning, texts))) if texts else ([], [])
    return [
        {
            **row.passthrough,
            "id": row.id,
            "output": texts[0] if texts else output.text,
            "finish_reason": output.finish_reason,
            "outputs": texts,
            **({"reasoning": thoughts[0] if thoughts else None, "reasonings": thoughts} if reasoning else {}),
            "finish_reasons": [s.finish_reason for s in samples],
            "output_token_counts": [len(s.token_ids) for s in samples],
            "logprobs": logprobs,
            "prompt_logprobs": prompt_logprobs,
            "echo": echo if row.values.get("echo") else None,
            "prompt_tokens": len(work.token_ids),
            "output_tokens": sum(len(s.token_ids) for s in samples),
            # A duplicate reuses the whole computed result, its prompt included.
            "cached_tokens": len(work.token_ids) if k else output.num_cached_tokens,
            "truncated": work.truncated,
            "error": output.error,
            "row_index": row.index,
            "queue_time_s": m and m.queue_time,
            "ttft_s": m and m.ttft,
            "total_time_s": m and m.total_time,
        }
        for k, row in enumerate(work.rows)
    ]


def _token_strings(tokenizer) -> Callable[[int], str]:
    """Each token id's text, decoded once per call: a prompt's alternatives repeat the same few tokens."""
    return functools.lru_cache(maxsize=None)(lambda i: tokenizer.decode([i], skip_special_tokens=False))


def _token_logprob(lp, token: Callable[[int], str]) -> dict:
    return {
        "token": token(lp.token_id),
        "logprob": lp.logprob,
        "top_logprobs": [{"token": token(i), "logprob": v} for i, v in lp.top],
    }


def _prompt_logprob(token_id: int, lp, token: Callable[[int], str]) -> dict:
    """A prompt token's entry: `lp` is None for the first token, which has no logprob."""
    if lp is None:
        return {"token": token(token_id), "token_id": token_id, "logprob": None, "rank": None, "top_logprobs": None}
    top = [{"token": token(i), "token_id": i, "logprob": v} for i, v in lp.top]
    return {"token": token(token_id), "token_id": token_id, "logprob": lp.logprob, "rank": lp.rank, "top_logprobs": top}


def score_schema(passthrough: pa.Schema, labels: bool, token_logprobs: bool) -> pa.Schema:
    """The columns of a scoring job's rows: a classification's (`labels`) or the NLL's, with `token_logprobs`."""
    values = [*LABEL_SCHEMA] if labels else [*NLL_SCHEMA]
    values += [("token_logprobs", pa.list_(TOKEN_LOGPROB))] if token_logprobs else []
    counts = [("prompt_tokens", pa.int32()), ("scored_tokens", pa.int32()), ("cached_tokens", pa.int32())]
    common = [("truncated", pa.bool_()), ("error", pa.string()), ("row_index", pa.int64())]
    return pa.schema([("id", pa.string()), *values, *counts, *common, *passthrough])


def score_rows(work, score, tokenizer, token_logprobs: bool, cached_tokens: int) -> list[dict]:
    """The output rows of a scored planner ScoreWork (one per input row it stands for, duplicates included) from its
    engine ScoreOutput; `cached_tokens`: of its requests' tokens, those read from the prefix cache."""
    if score.error is not None:
        values = {}
    elif score.labels is not None:
        values = {"label": score.label, "label_logprobs": score.label_logprobs, "label_probs": score.label_probs}
    else:
        values = {"sum_nll": score.sum_nll, "mean_nll": score.mean_nll, "perplexity": score.perplexity}
    if token_logprobs and score.token_logprobs is not None:
        token = _token_strings(tokenizer)
        values["token_logprobs"] = [_token_logprob(lp, token) for lp in score.token_logprobs]
    return [
        {
            **row.passthrough,
            "id": row.id,
            **values,
            "prompt_tokens": len(work.token_ids),
            "scored_tokens": None if score.error else work.scored_tokens,
            # A duplicate reuses the whole computed result, its tokens included.
            "cached_tokens": work.total_tokens if k else cached_tokens,
            "truncated": work.truncated,
            "error": score.error,
            "row_index": row.index,
        }
        for k, row in enumerate(work.rows)
    ]


def failed_row(row, error: str) -> dict:
    """The output row of an input row that never reached the engine."""
    return {**row.passthrough, "id": row.id, "error": error, "row_index": row.index}


def result_schema(passthrough: pa.Schema, reasoning: bool = False, prompt: bool = False) -> pa.Schema:
    """A generation job's columns; with `reasoning` (output.split_reasoning), the split-off reasoning too; with
    `prompt` (prompt_columns), the prompt's logprobs and echo."""
    split = [("reasoning", pa.string()), ("reasonings", pa.list_(pa.string()))] if reasoning else []
    scored = [("prompt_logprobs", pa.list_(PROMPT_LOGPROB)), ("echo", pa.string())] if prompt else []
    return pa.schema([*RESULT_SCHEMA, *split, *scored, *passthrough])


def prompt_columns(input_format: str, prompt_logprobs: int | None) -> bool:
    """Whether a generation job's rows may have prompt logprobs or an echo (PROMPT_COLUMNS): with
    sampling.prompt_logprobs, or OpenAI Batch input, any of whose lines may ask. Other jobs' columns stay as they
    were, so that the parts of an output folder written before these columns existed match those written after."""
    return prompt_logprobs is not None or input_format == "openai-batch"


def embedding_schema(passthrough: pa.Schema, dimension: int, per_line: bool) -> pa.Schema:
    """The columns of an embedding job's rows: `per_line` for OpenAI Batch input, whose lines hold lists of inputs."""
    if per_line:
        vectors = [("embeddings", pa.list_(pa.list_(pa.float32()))), ("encoding_format", pa.string())]
    else:
        vectors = [("embedding", pa.list_(pa.float32(), dimension))]
    common = [("prompt_tokens", pa.int32()), ("truncated", pa.bool_()), ("error", pa.string())]
    return pa.schema([("id", pa.string()), *vectors, *common, ("row_index", pa.int64()), *passthrough])


def embedding_row(row, vectors: list[list[float]], prompt_tokens: int, truncated: bool, per_line: bool) -> dict:
    """The output row of an input row whose inputs were embedded (a row of OpenAI Batch input may have several)."""
    record = {**row.passthrough, "id": row.id, "prompt_tokens": prompt_tokens, "truncated": truncated}
    if per_line:
        record |= {"embeddings": vectors, "encoding_format": row.values["encoding_format"]}
    else:
        record["embedding"] = vectors[0]
    return record | {"error": None, "row_index": row.index}
