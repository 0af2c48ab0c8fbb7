"""The OpenAI Batch API file format: request lines in, response lines out.

A request line is {"custom_id", "method": "POST", "url", "body": {"messages" | "prompt", "max_tokens", ...}}; a
response line is {"id", "custom_id", "response": {"status_code", "body": {"choices", "usage", ...}}, "error"}."""

from __future__ import annotations

import hashlib
import time
from typing import Any

CHAT_URL, COMPLETIONS_URL = "/v1/chat/completions", "/v1/completions"
# Body fields that become per-request sampling settings, by SamplingParams name.
SAMPLING_FIELDS = {
    "max_tokens": "max_tokens",
    "max_completion_tokens": "max_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "seed": "seed",
    "stop": "stop",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
}


class RequestLineError(ValueError):
    pass


def parse_request(obj: dict) -> tuple[dict, dict]:
    """The prompt values ({"messages": [...]} or {"prompt": "..."}) and sampling overrides of one request line."""
    if obj.get("method", "POST") != "POST":
        raise RequestLineError(f"method must be POST, got {obj.get('method')!r}")
    url, body = obj.get("url"), obj.get("body")
    if url not in (CHAT_URL, COMPLETIONS_URL):
        raise RequestLineError(f"url must be {CHAT_URL} or {COMPLETIONS_URL}, got {url!r}")
    if not isinstance(body, dict):
        raise RequestLineError("body must be an object")
    if body.get("n", 1) != 1:
        raise RequestLineError("body.n: only one choice per request is supported")
    overrides = {SAMPLING_FIELDS[k]: v for k, v in body.items() if k in SAMPLING_FIELDS and v is not None}
    if isinstance(overrides.get("stop"), str):
        overrides["stop"] = [overrides["stop"]]
    if url == CHAT_URL:
        if "messages" not in body:
            raise RequestLineError("body.messages is required for /v1/chat/completions")
        return {"messages": body["messages"]}, overrides
    if "prompt" not in body:
        raise RequestLineError("body.prompt is required for /v1/completions")
    return {"prompt": body["prompt"]}, overrides


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
    choice: dict[str, Any] = {"index": 0, "finish_reason": row["finish_reason"], "logprobs": None}
    if chat:
        choice["message"] = {"role": "assistant", "content": row["output"]}
    else:
        choice["text"] = row["output"]
    body = {
        "id": ("chatcmpl-" if chat else "cmpl-") + request_id[10:],
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
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
