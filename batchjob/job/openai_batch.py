"""The OpenAI Batch API file format: request lines in, response lines out.

A request line is {"custom_id", "method": "POST", "url", "body": {"messages" | "prompt", "max_tokens", ...}}; a
response line is {"id", "custom_id", "response": {"status_code", "body": {"choices", "usage", ...}}, "error"}."""

from __future__ import annotations

import hashlib
import time
from typing import Any

CHAT_URL, COMPLETIONS_URL = "/v1/chat/completions", "/v1/completions"
# Body fields that become per-request sampling settings, by SamplingParams name. top_k, min_p and
# repetition_penalty are vLLM's extensions to the OpenAI API. Of two fields for one setting, the later here wins.
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
    "response_format": "response_format",
}
# Honoured too: the prompt, `model` (every line names one; the job's model answers it) and `stream: false`.
OTHER_FIELDS = {CHAT_URL: {"messages", "model", "stream"}, COMPLETIONS_URL: {"prompt", "model", "stream"}}


class RequestLineError(ValueError):
    pass


def parse_request(obj: dict) -> tuple[dict, dict]:
    """The prompt values ({"messages": [...]} or {"prompt": "..."}) and sampling overrides of one request line.
    A body field that batchjob does not honour fails the line: it is never dropped silently."""
    if obj.get("method", "POST") != "POST":
        raise RequestLineError(f"method must be POST, got {obj.get('method')!r}")
    url, body = obj.get("url"), obj.get("body")
    if url not in (CHAT_URL, COMPLETIONS_URL):
        raise RequestLineError(f"url must be {CHAT_URL} or {COMPLETIONS_URL}, got {url!r}")
    if not isinstance(body, dict):
        raise RequestLineError("body must be an object")
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
    if url == COMPLETIONS_URL and "logprobs" in overrides:
        # /v1/completions: `logprobs: k` asks for the k likeliest tokens at each position.
        if "top_logprobs" in overrides:
            raise RequestLineError("unsupported field top_logprobs (/v1/completions takes logprobs: k)")
        k = overrides.pop("logprobs")
        if k is not False:
            overrides.update(logprobs=True, top_logprobs=0 if k is True else k)
    if url == CHAT_URL:
        if "messages" not in body:
            raise RequestLineError("body.messages is required for /v1/chat/completions")
        return {"messages": body["messages"]}, overrides
    if "prompt" not in body:
        raise RequestLineError("body.prompt is required for /v1/completions")
    return {"prompt": body["prompt"]}, overrides


def _chat_logprobs(entries: list[dict]) -> dict:
    def one(e: dict) -> dict:
        return {"token": e["token"], "logprob": e["logprob"], "bytes": list(e["token"].encode())}

    return {
        "content": [{**one(e), "top_logprobs": [one(t) for t in e["top_logprobs"]]} for e in entries],
        "refusal": None,
    }


def _completion_logprobs(entries: list[dict]) -> dict:
    offsets, at = [], 0
    for e in entries:
        offsets.append(at)
        at += len(e["token"])
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
        "text_offset": offsets,
    }


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
    chat = row.get("url") != COMPLETIONS_URL
    choices: list[dict[str, Any]] = []
    texts, reasons = row.get("outputs") or [row["output"]], row.get("finish_reasons") or [row["finish_reason"]]
    for i, (text, reason) in enumerate(zip(texts, reasons)):
        choice: dict[str, Any] = {"index": i, "finish_reason": reason, "logprobs": None}
        if row.get("logprobs") is not None:
            choice["logprobs"] = (_chat_logprobs if chat else _completion_logprobs)(row["logprobs"][i])
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
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
    return {
        "id": request_id,
        "custom_id": row["id"],
        "response": {"status_code": 200, "request_id": request_id, "body": body},
        "error": None,
    }
