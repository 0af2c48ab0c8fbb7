"""The OpenAI Batch API file format: request lines in, response lines out.

A request line is {"custom_id", "method": "POST", "url", "body": {"messages" | "prompt", "max_tokens", ...}}, or
{"body": {"input", "encoding_format", "dimensions"}} for /v1/embeddings; a response line is {"id", "custom_id",
"response": {"status_code", "body": {"choices" | "data", "usage", ...}}, "error"}."""

from __future__ import annotations

import base64
import hashlib
import time
from typing import Any

import numpy as np

from batchjob.engine.sampling_params import MAX_TOP_LOGPROBS

CHAT_URL, COMPLETIONS_URL, EMBEDDINGS_URL = "/v1/chat/completions", "/v1/completions", "/v1/embeddings"
URLS_BY_TASK = {"generate": (CHAT_URL, COMPLETIONS_URL), "embed": (EMBEDDINGS_URL,)}
MAX_EMBEDDING_INPUTS = 2048  # inputs of one /v1/embeddings line, as OpenAI's API allows
# Body fields that become per-request sampling settings, by SamplingParams name. top_k, min_p, repetition_penalty and
# prompt_logprobs are vLLM's extensions to the OpenAI API. Of two fields for one setting, the later here wins.
SAMPLING_FIELDS = {
    "max_tokens": "max_tokens",
    "max_completion_tokens": "max_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "seed": "seed",
    "stop": "stop",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "logit_bias": "logit_bias",
    "n": "n",
    "logprobs": "logprobs",
    "top_logprobs": "top_logprobs",
    "prompt_logprobs": "prompt_logprobs",
    "response_format": "response_format",
}
# Honoured too: the prompt, `model` (every line names one; the job's model answers it), `stream: false`, and on
# /v1/completions `echo` (the prompt before the completion, with its logprobs: the legacy way to score a text; on a
# chat line only `echo: false`).
OTHER_FIELDS = {
    CHAT_URL: {"messages", "model", "stream", "echo"},
    COMPLETIONS_URL: {"prompt", "model", "stream", "echo"},
}
# `user` only names the end user for the provider's abuse monitoring: nothing to honour offline.
EMBEDDING_FIELDS = {"input", "model", "encoding_format", "dimensions", "user"}


class RequestLineError(ValueError):
    pass


def parse_request(obj: dict, task: str = "generate") -> tuple[dict, dict]:
    """The prompt values ({"messages": [...]} or {"prompt": "..."}; {"input": [...], "encoding_format",
    "dimensions"} for /v1/embeddings) and sampling overrides of one request line of a job of `task`. A body field
    that batchjob does not honour fails the line: it is never dropped silently."""
    if obj.get("method", "POST") != "POST":
        raise RequestLineError(f"method must be POST, got {obj.get('method')!r}")
    url, body = obj.get("url"), obj.get("body")
    urls = URLS_BY_TASK[task]
    if url not in urls:
        other = next((t for t, u in URLS_BY_TASK.items() if url in u), None)
        if other:
            raise RequestLineError(f"url {url} needs task: {other}, and this job's task is {task}")
        raise RequestLineError(f"url must be {' or '.join(urls)}, got {url!r}")
    if not isinstance(body, dict):
        raise RequestLineError("body must be an object")
    if url == EMBEDDINGS_URL:
        return _embedding_request(body), {}
    if url == CHAT_URL and body.get("echo"):
        raise RequestLineError(
            "unsupported field echo: only /v1/completions lines echo their prompt (vLLM's chat echo, which repeats "
            "the last message, is not supported); prompt_logprobs gives a chat prompt's logprobs"
        )
    unsupported = sorted(k for k in body if k not in SAMPLING_FIELDS and k not in OTHER_FIELDS[url])
    if unsupported:
        raise RequestLineError(f"unsupported field {', '.join(unsupported)}")
    if body.get("stream"):
        raise RequestLineError("unsupported field stream: true (a batch has no stream)")
    # In SAMPLING_FIELDS' order, not the line's: of max_tokens and max_completion_tokens, the latter wins, as in
    # OpenAI's API and vLLM.
    overrides = {name: body[k] for k, name in SAMPLING_FIELDS.items() if body.get(k) is not None}
    if isinstance(overrides.get("stop"), str):
        overrides["stop"] = [overrides["stop"]]
    if "prompt_logprobs" in overrides:
        _check_count("prompt_logprobs", overrides["prompt_logprobs"])
    if url == CHAT_URL:
        if "messages" not in body:
            raise RequestLineError("body.messages is required for /v1/chat/completions")
        return {"messages": body["messages"]}, overrides
    if "logprobs" in overrides:
        # /v1/completions: `logprobs: k` asks for the k likeliest tokens at each position (a count: `true` is no k).
        if "top_logprobs" in overrides:
            raise RequestLineError("unsupported field top_logprobs (/v1/completions takes logprobs: k)")
        overrides.update(logprobs=True, top_logprobs=_check_count("logprobs", overrides["logprobs"]))
    if "prompt" not in body:
        raise RequestLineError("body.prompt is required for /v1/completions")
    echo = body.get("echo") or False  # null: the default, as for the other fields
    if not isinstance(echo, bool):
        raise RequestLineError(f"body.echo must be true or false, got {echo!r}")
    if echo and overrides.get("logprobs"):
        # The echoed prompt's logprobs are its prompt logprobs: with the line's own count, or logprobs' (as vLLM).
        overrides.setdefault("prompt_logprobs", overrides["top_logprobs"])
    return {"prompt": body["prompt"], **({"echo": True} if echo else {})}, overrides


def _check_count(name: str, k: Any) -> int:
    """A count of likeliest tokens (logprobs: k, prompt_logprobs: k): an integer the engine gives."""
    if not (_is_token_id(k) and k <= MAX_TOP_LOGPROBS):
        raise RequestLineError(f"body.{name} must be an integer from 0 to {MAX_TOP_LOGPROBS}, got {k!r}")
    return k


def _embedding_request(body: dict) -> dict:
    unsupported = sorted(k for k in body if k not in EMBEDDING_FIELDS)
    if unsupported:
        raise RequestLineError(f"unsupported field {', '.join(unsupported)}")
    inputs = body.get("input")
    if isinstance(inputs, str) or (isinstance(inputs, list) and inputs and all(_is_token_id(t) for t in inputs)):
        inputs = [inputs]  # one text, or one array of token ids
    if not isinstance(inputs, list) or not inputs:
        raise RequestLineError("body.input must be a text, an array of texts or of token ids, and not empty")
    if len(inputs) > MAX_EMBEDDING_INPUTS:
        raise RequestLineError(f"body.input has {len(inputs)} inputs; at most {MAX_EMBEDDING_INPUTS} a line")
    for i, one in enumerate(inputs):
        if isinstance(one, (int, float)):  # a flat array with a value that is no token id
            bad = next(t for t in inputs if not _is_token_id(t))
            raise RequestLineError(f"body.input: {bad!r} is not a token id (a non-negative integer)")
        if isinstance(one, str) and one:
            continue
        if not (isinstance(one, list) and one and all(_is_token_id(t) for t in one)):
            raise RequestLineError(f"body.input[{i}] must be a non-empty text or array of token ids")
    encoding = body.get("encoding_format") or "float"  # null: the default, as for the other fields
    if encoding not in ("float", "base64"):
        raise RequestLineError(f"body.encoding_format must be float or base64, got {encoding!r}")
    dimensions = body.get("dimensions")
    if dimensions is not None and not (_is_token_id(dimensions) and dimensions > 0):
        raise RequestLineError(f"body.dimensions must be a positive integer, got {dimensions!r}")
    return {"input": inputs, "encoding_format": encoding, "dimensions": dimensions}


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _chat_logprobs(entries: list[dict]) -> dict:
    def one(e: dict) -> dict:
        return {"token": e["token"], "logprob": e["logprob"], "bytes": list(e["token"].encode())}

    return {
        "content": [{**one(e), "top_logprobs": [one(t) for t in e["top_logprobs"]]} for e in entries],
        "refusal": None,
    }


def _completion_logprobs(entries: list[dict], at: int = 0) -> dict:
    """The legacy completions API's logprobs of `entries` (an echoed prompt's, then the completion's: a prompt's
    first token has none, hence its nulls), their text offsets counted from `at`."""
    offsets = []
    for e in entries:
        offsets.append(at)
        at += len(e["token"])
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [
            None if e["top_logprobs"] is None else {t["token"]: t["logprob"] for t in e["top_logprobs"]}
            for e in entries
        ],
        "text_offset": offsets,
    }


def _prompt_logprobs(entries: list[dict]) -> list[dict | None]:
    """vLLM's prompt_logprobs: per prompt token, None for the first, else {token id: {logprob, rank, decoded_token}}
    of the token itself and its likeliest alternatives."""

    def one(e: dict, rank: int) -> dict:
        return {"logprob": e["logprob"], "rank": rank, "decoded_token": e["token"]}

    out: list[dict | None] = []
    for e in entries:
        if e["logprob"] is None:
            out.append(None)
            continue
        ranked = {str(e["token_id"]): one(e, e["rank"])}
        for rank, t in enumerate(e["top_logprobs"], 1):
            ranked.setdefault(str(t["token_id"]), one(t, rank))
        out.append(ranked)
    return out


def format_response(row: dict, model: str) -> dict:
    """One output line for a result row (a dict of the output Parquet columns, with the `url` pass-through)."""
    request_id = "batch_req_" + hashlib.sha256(row["id"].encode()).hexdigest()[:24]
    if row["error"] is not None:
        return {
            "id": request_id,
            "custom_id": row["id"],
            "response": None,
            "error": {"code": "row_error", "message": row["error"]},
        }
    if row.get("url") == EMBEDDINGS_URL:
        return _response(request_id, row["id"], _embedding_body(row, model))
    chat = row.get("url") != COMPLETIONS_URL
    choices: list[dict[str, Any]] = []
    texts, reasons = row.get("outputs") or [row["output"]], row.get("finish_reasons") or [row["finish_reason"]]
    # vLLM's prompt_logprobs field: in each choice of a completion, at the top of a chat completion's body
    prompt_logprobs = None if row.get("prompt_logprobs") is None else _prompt_logprobs(row["prompt_logprobs"])
    echo = row.get("echo")  # the prompt as the engine read it, on a /v1/completions line with echo: true
    for i, (text, reason) in enumerate(zip(texts, reasons)):
        choice: dict[str, Any] = {"index": i, "finish_reason": reason, "logprobs": None}
        if row.get("logprobs") is not None and chat:
            choice["logprobs"] = _chat_logprobs(row["logprobs"][i])
        elif row.get("logprobs") is not None:
            # an echoed prompt's logprobs come first; without them (echo, but logprobs from the job file) the
            # completion's offsets still count the echoed text
            echoed = (row.get("prompt_logprobs") or []) if echo is not None else []
            at = len(echo) if echo is not None and not echoed else 0
            choice["logprobs"] = _completion_logprobs(echoed + row["logprobs"][i], at)
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
            if row.get("reasonings") is not None:  # output.split_reasoning, as vLLM's reasoning parsers answer
                choice["message"]["reasoning_content"] = row["reasonings"][i]
        else:
            choice["text"] = text if echo is None else echo + text
            if prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs
        choices.append(choice)
    body = {
        "id": ("chatcmpl-" if chat else "cmpl-") + request_id[10:],
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": {
            "prompt_tokens": row["prompt_tokens"],
            "completion_tokens": row["output_tokens"],
            "total_tokens": row["prompt_tokens"] + row["output_tokens"],
            "prompt_tokens_details": {"cached_tokens": row["cached_tokens"]},
        },
    }
    if chat and prompt_logprobs is not None:
        body["prompt_logprobs"] = prompt_logprobs
    return _response(request_id, row["id"], body)


def _embedding_body(row: dict, model: str) -> dict:
    def encode(vector: list[float]) -> list[float] | str:
        if row["encoding_format"] == "base64":  # little-endian float32, as OpenAI's API encodes it
            return base64.b64encode(np.asarray(vector, "<f4").tobytes()).decode()
        return vector

    data = [{"object": "embedding", "index": i, "embedding": encode(v)} for i, v in enumerate(row["embeddings"])]
    usage = {"prompt_tokens": row["prompt_tokens"], "total_tokens": row["prompt_tokens"]}
    return {"object": "list", "data": data, "model": model, "usage": usage}


def _response(request_id: str, custom_id: str, body: dict) -> dict:
    return {
        "id": request_id,
        "custom_id": custom_id,
        "response": {"status_code": 200, "request_id": request_id, "body": body},
        "error": None,
    }
