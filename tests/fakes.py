"""A small deterministic engine with the real Engine's contract, for fast tests of the job runner.

Tokens are UTF-8 bytes; the answer is the user text's words reversed, cut to max_tokens bytes. Requests finish
shortest prompt first, so completion order differs from admission order as with the real engine. Each finished
request takes `steps_per_output` engine steps (a long run, for the timeline's sampling). A request is scheduled and
gets its first token at the first step after it is admitted, and finishes when it is answered. `step_metrics(step)`
overrides fields of each step's reported StepMetrics (figures that vary from step to step)."""

from __future__ import annotations

import copy
import os
import signal
import time
from collections.abc import Callable

from batchjob.engine.config import EngineConfig
from batchjob.engine.outputs import Request, RequestMetrics, RequestOutput, StepMetrics


class FakeTokenizer:
    chat_template: str | None = "<|{role}|>{content}"  # what apply_chat_template writes; None: a model without one
    template_head = ""  # the chat_template_kwargs it was given, written first

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [self.encode(t, add_special_tokens) for t in texts]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode("utf-8", "ignore")

    def escape(self, data: str, special_tokens: bool = True) -> str:
        return data  # its tokens are bytes: no text of a row is a special token

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        text = self.template_head + "".join(f"<|{m['role']}|>{m['content']}\n" for m in messages)
        return text + ("<|assistant|>" if add_generation_prompt else "")

    def encode_chats(self, chats: list[tuple[list[dict], int]]) -> list[list[int] | Exception]:
        return [self.encode(self.apply_chat_template(messages), add_special_tokens=False) for messages, _ in chats]

    def with_template_kwargs(self, kwargs: dict) -> FakeTokenizer:
        """A tokenizer whose rendering starts with the kwargs, so that a test sees they reached the template."""
        other = copy.copy(self)
        other.template_head = self.template_head + "".join(f"<|{k}={v}|>" for k, v in sorted(kwargs.items()))
        return other


class FakeEngine:
    def __init__(
        self,
        model: str = "fake",
        *,
        max_num_seqs: int = 4,
        block_size: int = 16,
        max_model_len: int = 512,
        signal_at: tuple[int, ...] = (),
        steps_per_output: int = 1,
        signum: int = signal.SIGTERM,
        step_metrics: Callable[[int], dict] | None = None,
    ):
        self.config = EngineConfig(max_num_seqs=max_num_seqs, block_size=block_size)
        self.max_model_len = max_model_len
        self.tokenizer = FakeTokenizer()
        self.model_digest = f"digest-of-{model}"
        self.model_revision = None
        self.lora_digests: dict[str, str] = {}
        self.image_prompter = None  # reads text only
        self.numerics = {"device": "cpu", "dtype": "float32", "kv_cache_dtype": "float32", "ops_backend": "fake"}
        self.kv_bytes_per_token, self.num_kv_blocks = 1024, 256
        self.kv_pool_sized_by = "num_kv_blocks"  # a fixed pool: fit_kv_pool keeps it
        self.token_budget, self.auto_budget = 64, None
        # send `signum` to this process after these numbers of outputs, as a scheduler (or a closed terminal) would
        self.signal_at, self.signum = signal_at, signum
        self.steps_per_output = steps_per_output
        self.step_metrics = step_metrics
        self.callbacks = []
        self.prompts_seen: list[list[int]] = []
        self._aborting = False
        self._step = 0

    def add_step_callback(self, fn) -> None:
        self.callbacks.append(fn)

    def abort_all(self) -> None:
        self._aborting = True

    def abort_waiting(self) -> None:
        """Every request this fake has pulled is running: none waits."""

    def stream(self, requests):
        source, running, exhausted, emitted = iter(requests), [], False, 0
        self._aborting = False
        while True:
            while not exhausted and not self._aborting and len(running) < self.config.max_num_seqs:
                request = next(source, None)
                if request is None:
                    exhausted = True
                else:
                    self.prompts_seen.append(request.prompt_token_ids)
                    running.append((request, RequestMetrics(arrival_time=time.time())))
            if self._aborting:
                for request, metrics in running:
                    yield RequestOutput(request.request_id, request.prompt_token_ids, [], "", "abort", metrics=metrics)
                return
            if not running:
                return
            for _ in range(self.steps_per_output):
                self._step += 1
                fields = {
                    "step": self._step,
                    "time": time.time(),
                    "step_time": 0.001,
                    "num_seqs": len(running),
                    "num_prefill_tokens": 0,
                    "num_decode_tokens": len(running),
                    "kv_cache_usage": 0.5,
                    "num_preemptions": 0,
                    "prefix_cache_queries": 10,
                    "prefix_cache_hits": 5,
                    "num_waiting": 0 if exhausted else 1,
                    "num_running": len(running),
                    "token_budget": self.token_budget,
                }
                if self.step_metrics:
                    fields.update(self.step_metrics(self._step))
                for fn in self.callbacks:
                    fn(StepMetrics(**fields))
                for _, metrics in running:
                    if metrics.first_token_time is None:
                        metrics.first_scheduled_time = metrics.first_token_time = time.time()
            running.sort(key=lambda item: len(item[0].prompt_token_ids))
            request, metrics = running.pop(0)
            yield self._answer(request, metrics)
            emitted += 1
            if emitted in self.signal_at:
                os.kill(os.getpid(), self.signum)

    def _answer(self, request, metrics: RequestMetrics) -> RequestOutput:
        prompt = self.tokenizer.decode(request.prompt_token_ids)
        user = prompt.rsplit("<|user|>", 1)[-1].split("\n<|assistant|>")[0]
        ids = list(" ".join(reversed(user.split())).encode())
        cut = ids[: request.params.max_tokens]
        metrics.finished_time = time.time()
        if metrics.first_token_time is None:  # generate(): answered at once
            metrics.first_scheduled_time = metrics.first_token_time = metrics.finished_time
        return RequestOutput(
            request.request_id,
            request.prompt_token_ids,
            cut,
            self.tokenizer.decode(cut),
            "length" if len(cut) < len(ids) else "stop",
            metrics=metrics,
        )

    def largest_step_host_bytes(self) -> int | None:
        return None  # no model, no memory to measure

    def fit_kv_pool(self, num_blocks: int) -> bool:
        return False

    def generate(self, prompts, params, use_tqdm=True, lora=None):
        requests = [Request(str(i), list(p), params, lora=lora) for i, p in enumerate(prompts)]
        return [self._answer(r, RequestMetrics(arrival_time=time.time())) for r in requests]
