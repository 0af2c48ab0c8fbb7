"""The public API: Engine(model, **config).generate(...), .chat(...) and .stream(...), as a vLLM user expects."""

from __future__ import annotations

import contextlib
import itertools
import operator
import time
from collections.abc import Callable, Iterable, Iterator

import torch

from batchjob.engine.block_manager import BlockManager
from batchjob.engine.config import PROFILES, EngineConfig
from batchjob.engine.decode_graphs import DecodeGraphs
from batchjob.engine.host_sync import device_index
from batchjob.engine.memory_profile import MemoryProfile
from batchjob.engine.model_runner import ModelRunner, keep_gguf_blocks, pick_device, pick_dtype
from batchjob.engine.outputs import (
    CompletionOutput,
    Request,
    RequestOutput,
    ScoreOutput,
    StepMetrics,
    row_requests,
    score_output,
)
from batchjob.engine.prompt_logprobs import prompt_logprob_rows
from batchjob.engine.sampler import Sampler, takes_argmax
from batchjob.engine.sampling_params import SamplingParams
from batchjob.engine.scheduler import Scheduler, SchedulerOutput
from batchjob.engine.sequence import Sequence, SequenceStatus
from batchjob.engine.step_runner import StepRunner
from batchjob.engine.structured_output import StructuredOutput
from batchjob.engine.token_budget import AutoTokenBudget, budget_cap
from batchjob.model.builtin import DEFAULT_MODEL
from batchjob.model.dummy import load_dummy
from batchjob.model.llama import LlamaModel
from batchjob.model.loader import load_model
from batchjob.model.vision.images import ImageError, ImagePrompt

__all__ = ["Engine", "EngineConfig", "Request", "SamplingParams", "RequestOutput", "ScoreOutput"]


class Engine:
    def __new__(cls, model: str = DEFAULT_MODEL, task: str = "generate", **config):
        """`task="embed"` gives an Embedder (engine/embedder.py) for the model, as vLLM's LLM(model, task="embed")
        gives an engine whose embed() works."""
        if task == "embed":
            from batchjob.engine.embedder import Embedder

            return Embedder(model, **config)
        if task != "generate":
            raise ValueError(f"task must be 'generate' or 'embed', got {task!r}")
        return super().__new__(cls)

    def __init__(self, model: str = DEFAULT_MODEL, task: str = "generate", **config):
        self.config = EngineConfig(**config)
        if self.config.load_format == "dummy":
            device = pick_device(self.config)
            loaded = load_dummy(model, self.config.seed, device, pick_dtype(self.config, device))
        else:
            device = pick_device(self.config)
            loaded = load_model(model, quantized=keep_gguf_blocks(self.config, device, pick_dtype(self.config, device)))
        self.model_config, self.tokenizer, self.model_digest = loaded.config, loaded.tokenizer, loaded.digest
        self.model_path = loaded.path  # the GGUF file or HF folder (with load_format dummy, the config.json)
        self.model_revision = loaded.revision  # the Hub commit of a model named by Hub id, else None
        # Within a sliding window attention is plain causal attention, so capping the context keeps results exact.
        self.max_model_len = min(
            self.config.max_model_len or loaded.config.max_position_embeddings,
            loaded.config.max_position_embeddings,
            loaded.config.context_window or 1 << 30,
        )
        auto = self.config.max_num_batched_tokens == "auto"
        # With "auto" the runner leaves activation memory for the largest budget the tuner may pick.
        cap = budget_cap(self.config.max_num_seqs, self.max_model_len)
        self.runner = ModelRunner(
            self.config.model_copy(update={"max_num_batched_tokens": cap}) if auto else self.config,
            loaded,
            self.max_model_len,
        )
        self.kv_bytes_per_token = self.runner.kv_bytes_per_token
        self.numerics = self.runner.numerics
        self.num_kv_blocks = self.runner.num_blocks
        # Fixed here: a pool that a job shrinks later holds every sequence the scheduler may run at once, so the
        # quarter of the pool this keeps one step of prefill within is not needed there (fit_kv_pool).
        self.budget_cap = budget_cap(
            self.config.max_num_seqs, self.max_model_len, self.num_kv_blocks * self.config.block_size
        )
        self._make_scheduler()
        self.sampler = Sampler(self.config.seed)
        self.eos_token_ids = set(loaded.config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self.structured = StructuredOutput(self.tokenizer, loaded.config.vocab_size, list(self.eos_token_ids))
        self.image_prompter = None  # a vision-language model's: prompts with images through its own processor
        if loaded.vision is not None:
            from batchjob.model.vision.images import ImagePrompter

            self.image_prompter = ImagePrompter(loaded.path, loaded.vision.config)
        self._step_callbacks: list[Callable[[StepMetrics], None]] = []
        self._arrivals = itertools.count()
        self._request_counter = itertools.count()
        self._in_flight: dict[str, Sequence] = {}  # by request id: what a later request's `after` names
        self._streaming = False
        self._aborting = False
        self._aborting_waiting = False
        self.step_count = 0
        self.last_step: StepMetrics | None = None

    # -- public API ---------------------------------------------------------------------------------------------
    def add_step_callback(self, fn: Callable[[StepMetrics], None]) -> None:
        self._step_callbacks.append(fn)

    def remove_step_callback(self, fn: Callable[[StepMetrics], None]) -> None:
        self._step_callbacks.remove(fn)

    def reset_prefix_cache(self) -> None:
        """Drop the cached prefix blocks and zero the hit counters, so that the next stream starts cold."""
        self.block_manager.reset_prefix_cache()
        self.scheduler.reset_prefix_stats()

    def set_decode_graphs(self, enabled: bool, capture: bool = True) -> None:
        """Decode through padded graphs (captured; without `capture`, their body run eagerly, a CPU's stand-in), or
        step by step: what the device check compares."""
        self.runner.set_decode_graphs(enabled, capture)

    @property
    def device(self) -> torch.device:
        return self.runner.device

    @property
    def dtype(self) -> torch.dtype:
        return self.runner.dtype

    @property
    def model(self) -> LlamaModel:
        return self.runner.model

    @property
    def memory_profile(self) -> MemoryProfile | None:
        """What the KV pool was sized against, on a GPU."""
        return self.runner.memory

    @property
    def decode_graphs(self) -> DecodeGraphs | None:
        return self.runner.decode_graphs

    def forbid_host_sync(self, forbid: bool = True) -> None:
        """Raise at any host synchronisation inside a step (the device check's guard of the Triton path)."""
        self.runner.forbid_host_sync = forbid

    def largest_step_host_bytes(self) -> int | None:
        """On a CPU, the resident memory a step over the full token budget adds at its peak (ModelRunner's); else
        None. Starts this process's peak RSS afresh."""
        return self.runner.largest_step_host_bytes()

    def step_runner(self) -> StepRunner:
        """Steps of sequences the caller batches itself, through this engine's KV blocks, model and sampler."""
        return StepRunner(self.block_manager, self.runner, self.sampler)

    def generate(
        self,
        prompts: list[str] | list[list[int]] | list[dict],
        params: SamplingParams | list[SamplingParams] | tuple[SamplingParams, ...] | None = None,
        use_tqdm: bool = True,
        lora: str | list[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Outputs in input order. Text prompts are tokenized as they are (no chat template; see chat()). A
        vision-language model's prompt may be {"prompt": "... <image> ...", "images": [...]}, one image (a PIL
        image, encoded bytes or a local path) for each <image>; an image that cannot be read, or images given to a
        text-only model, fail that prompt alone (finish_reason "error"). use_tqdm shows a tqdm.auto bar (a widget in
        notebooks) with requests done and output tokens/s. `lora` names an adapter of engine.lora for every prompt,
        or one per prompt (None: the base model)."""
        from tqdm.auto import tqdm

        if isinstance(prompts, str):  # one prompt, as vLLM takes it
            prompts = [prompts]
        if params is None:
            params = SamplingParams()
        if isinstance(params, list | tuple) and len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params: the lengths must be the same")
        plist = params if isinstance(params, list | tuple) else [params] * len(prompts)
        loras = _per_prompt(lora, len(prompts))
        # Ids unique to this engine (vLLM's request counter): an output can only be matched to its own call.
        order = [str(next(self._request_counter)) for _ in prompts]
        inputs = [self._prompt_form(p) for p in prompts]  # a malformed prompt raises before any request runs
        done: dict[str, RequestOutput] = {}

        def requests() -> Iterator[Request]:
            """Images are read as the stream pulls their request: their pixels are large, a queue's worth is held."""
            for request_id, p, sp, name in zip(order, inputs, plist, loras):
                try:
                    ids, images = (p, None) if isinstance(p, list) else self._image_input(p)
                except ImageError as e:
                    done[request_id] = RequestOutput(request_id, [], [], "", "error", error=str(e))
                    bar.update(1)
                    continue
                yield Request(request_id, ids, sp, lora=name, images=images)

        start, tokens = time.perf_counter(), 0
        with (
            tqdm(total=len(order), desc="Processed prompts", unit="req", disable=not use_tqdm) as bar,
            contextlib.closing(self.stream(requests())) as outputs,
        ):
            for out in outputs:
                done[out.request_id] = out
                tokens += sum(len(s.token_ids) for s in out.samples)
                bar.set_postfix_str(f"output {tokens / (time.perf_counter() - start):,.0f} tok/s", refresh=False)
                bar.update(1)
        return [done[request_id] for request_id in order]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """generate() over conversations ([{role, content}, ...], or a list of them) through the model's chat
        template, with the assistant's turn opened; `chat_template_kwargs` are the template's own switches (Qwen3's
        enable_thinking), as in vLLM's LLM.chat."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.tokenizer.with_template_kwargs(chat_template_kwargs or {})
        # Text given here may spell special tokens (as vLLM reads it); the escaper's mark character stays itself.
        chats = [tokenizer.escape_messages(c, special_tokens=False) for c in conversations]
        return self.generate([tokenizer.encode_chat(c) for c in chats], params, use_tqdm)

    def score(
        self,
        prompts: list[str] | list[list[int]],
        continuations: list[str] | list[list[int]] | None = None,
        labels: list[str] | None = None,
        prompt_logprobs: int = 0,
        use_tqdm: bool = True,
        lora: str | list[str | None] | None = None,
    ) -> list[ScoreOutput]:
        """Teacher-forced scoring, in input order: one prefill a row and no decode (prompt-only requests, packed
        into the token budget and chunked as any prefill). Each row scores its prompt's tokens after the first, or
        its continuation's given the prompt; with `labels`, each label as the prompt's continuation, the labels of
        a row reading the prompt's blocks from the prefix cache after one of them has computed them.
        `prompt_logprobs` is the number of likeliest alternatives kept with each scored token's logprob; `lora` as
        in generate()."""
        from tqdm.auto import tqdm

        if isinstance(prompts, str):
            prompts = [prompts]
        if continuations is not None and labels is not None:
            raise ValueError("score: continuations or labels, not both")
        if continuations is not None and len(continuations) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(continuations)} continuations: the lengths must match")
        if labels is not None and not labels:
            raise ValueError("score: labels needs at least one label")
        params = SamplingParams(max_tokens=0, prompt_logprobs=prompt_logprobs)
        loras = _per_prompt(lora, len(prompts))
        rows = []  # (row id, start, request ids)
        requests = []
        for i, prompt in enumerate(prompts):
            ids, row_id = self._prompt_ids(prompt), str(next(self._request_counter))
            if labels is not None:
                tails = [self._continuation_ids(label) for label in labels]
            else:
                tails = [self._continuation_ids(continuations[i])] if continuations is not None else [[]]
            start = len(ids) if labels is not None or continuations is not None else 1
            row = row_requests(row_id, ids, tails, start, params, labels is not None, loras[i])
            requests += row
            rows.append((row_id, start, [r.request_id for r in row]))
        done: dict[str, RequestOutput] = {}
        with (
            tqdm(total=len(requests), desc="Scored requests", unit="req", disable=not use_tqdm) as bar,
            contextlib.closing(self.stream(requests)) as outputs,
        ):
            for out in outputs:
                done[out.request_id] = out
                bar.update(1)
        return [score_output(row_id, [done[r] for r in ids], start, labels) for row_id, start, ids in rows]

    def _continuation_ids(self, text: str | list[int]) -> list[int]:
        """A continuation's tokens as they follow a prompt: without the special tokens a prompt opens with."""
        return (
            self.tokenizer.encode(self.tokenizer.escape(text, special_tokens=False), add_special_tokens=False)
            if isinstance(text, str)
            else self._prompt_ids(text)
        )

    def stream(self, requests: Iterable[Request]) -> Iterator[RequestOutput]:
        """Pulls requests lazily while there is room for them and yields each output as soon as it finishes.
        However the stream ends (an exception, or the caller closing it), no request of it stays in the engine.
        One stream at a time: a second one (a generate() from a step callback, say) would take the first one's
        outputs."""
        if self._streaming:
            raise RuntimeError("this engine is already running a stream or generate(): finish or close that first")
        source = iter(requests)
        self._streaming = True
        self._aborting = self._aborting_waiting = False
        try:
            yield from self._stream(source)
        finally:
            self._drop_in_flight()
            self._streaming = False

    def _stream(self, source: Iterator[Request]) -> Iterator[RequestOutput]:
        exhausted = False
        while True:
            while not exhausted and not self._aborting and self._wants_more():
                req = next(source, None)
                if req is None:
                    exhausted = True
                else:
                    rejected = self._add(req)
                    if rejected is not None:
                        yield rejected
            if self._aborting:
                yield from self._abort_in_flight()
                return
            if self._aborting_waiting:
                self._aborting_waiting = False
                yield from self._abort_waiting()
            if not self.scheduler.has_work():
                if exhausted:
                    return
                continue
            yield from self.step()

    @property
    def token_budget(self) -> int:
        """max_num_batched_tokens: the configured one, or the one the tuner holds best so far (the level it tries in
        a given step is that step's StepMetrics.token_budget)."""
        return self.auto_budget.chosen if self.auto_budget else self.config.max_num_batched_tokens

    @property
    def auto_budget(self) -> AutoTokenBudget | None:
        """The tuner of `max_num_batched_tokens: auto` (its summary() says what it measured); None if fixed."""
        return self.scheduler.auto_budget

    @property
    def lora_digests(self) -> dict[str, str]:
        """Each LoRA adapter's content digest (sha256 of its files), by name; empty without engine.lora."""
        return dict(self.runner.lora.digests) if self.runner.lora else {}

    @property
    def kv_pool_sized_by(self) -> str:
        """What sized the KV pool: "num_kv_blocks", "kv_cache_memory_gb", "gpu_memory", on a CPU "default" (2 GiB,
        or half the memory available after the load where less), or "job" (fit_kv_pool)."""
        return self.runner.pool_sized_by

    def fit_kv_pool(self, num_blocks: int) -> bool:
        """Shrink a CPU pool that the defaults sized to `num_blocks`, what a job's requests need at most at once
        (job/kv_pool.py), before any request: the block manager hands out blank blocks before reusing cached ones,
        so a long run makes its whole pool resident. A pool a setting or a GPU's memory sized, one no larger, or one
        already in use stays; returns whether it shrank."""
        if self.kv_pool_sized_by != "default" or num_blocks >= self.num_kv_blocks or self.step_count:
            return False
        self.runner.shrink_pool(max(1, num_blocks))
        self.num_kv_blocks = self.runner.num_blocks
        self._make_scheduler()
        return True

    def _make_scheduler(self) -> None:
        self.block_manager = BlockManager(
            self.num_kv_blocks, self.config.block_size, self.config.enable_prefix_caching, self.max_model_len
        )
        auto = self.config.max_num_batched_tokens == "auto"
        self.scheduler = Scheduler(self.config, self.block_manager, self._auto_budget() if auto else None)

    def set_token_budget(self, budget: int | str) -> None:
        """A fixed budget, or "auto" to tune it afresh (as at the start of a run)."""
        self.config.max_num_batched_tokens = budget
        self.scheduler.auto_budget = self._auto_budget() if budget == "auto" else None

    def abort_all(self) -> None:
        """Ends the current stream: in-flight requests come out with finish_reason "abort"."""
        self._aborting = True

    def abort_waiting(self) -> None:
        """Queued requests that hold no KV blocks come out with finish_reason "abort"; running ones go on."""
        self._aborting_waiting = True

    # -- internals ----------------------------------------------------------------------------------------------
    def _auto_budget(self) -> AutoTokenBudget:
        # Tuning starts from the profile's fixed budget: "auto" begins where the untuned default would stay.
        return AutoTokenBudget(self.budget_cap, start=PROFILES[self.config.profile]["max_num_batched_tokens"])

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        """A text prompt tokenized, or a list of token ids as ints; anything else raises before any request runs."""
        if isinstance(prompt, str):  # its special-token strings are tokens, the escaper's mark character is itself
            return self.tokenizer.encode(self.tokenizer.escape(prompt, special_tokens=False))
        try:
            return [operator.index(t) for t in prompt]
        except TypeError:
            raise TypeError(f"a prompt is a string or a list of token ids (ints), got {prompt!r:.80}") from None

    def _prompt_form(self, prompt: str | list[int] | dict) -> list[int] | dict:
        """A prompt's token ids, or a prompt with images as it is (checked for its form: TypeError otherwise)."""
        if not isinstance(prompt, dict):
            return self._prompt_ids(prompt)
        images = [] if prompt.get("images") is None else prompt["images"]
        # a list's form only: bytes would be read as ints, a dict as its keys, one image fail inside the stream
        if (
            set(prompt) - {"prompt", "images"}
            or not isinstance(prompt.get("prompt"), str)
            or not isinstance(images, list | tuple)
        ):
            raise TypeError(f'a prompt dict is {{"prompt": str, "images": [images]}}, got {prompt!r:.80}')
        return prompt if images else self._prompt_ids(prompt["prompt"])

    def _image_input(self, prompt: dict) -> tuple[list[int], ImagePrompt]:
        """The token ids and images of a prompt with images, as the model's processor makes them; ImageError where
        an image cannot be used or the model reads text only (that prompt alone fails)."""
        if self.image_prompter is None:
            raise ImageError(f"model {self.model_path.name} takes no images: it is not a vision-language model")
        made = self.image_prompter(prompt["prompt"], list(prompt["images"]))
        return made.token_ids, made

    def _image_error(self, req: Request) -> str | None:
        """Why a request's images cannot run: images for a text-only model, image tokens without images, or
        images that are not the ones its image tokens stand for (a Request built by hand)."""
        encoder = self.runner.image_encoder
        if encoder is None:
            return None if req.images is None else "this model takes no images: it is not a vision-language model"
        c = encoder.config
        positions = [i for i, t in enumerate(req.prompt_token_ids) if t == c.image_token_id]
        if req.images is None:
            return "the prompt holds image tokens but no images" if positions else None
        pixels, mask = req.images.pixel_values, req.images.pixel_attention_mask
        if not encoder.takes(pixels, mask):
            return "the request's images are not tiles of this model's (as its processor makes them)"
        if positions != list(req.images.positions) or len(positions) != len(pixels) * c.tokens_per_tile:
            return "the request's images do not match its image tokens"
        return None

    def _wants_more(self) -> bool:
        # Enough queued to fill the next steps; the rest stays in the caller's iterator (bounded memory).
        return len(self.scheduler.waiting) < max(2 * self.config.max_num_seqs, 64)

    def _add(self, req: Request) -> RequestOutput | None:
        seq = Sequence(req, next(self._arrivals))
        n = seq.num_prompt_tokens
        # No sequence grows past the context (it ends there with "length", as in vLLM): capped here, before anything
        # is sized by it, whatever max_tokens the request asks for.
        seq.max_tokens = min(seq.max_tokens, max(self.max_model_len - n, 0))
        error = None
        if n == 0:
            error = "empty prompt"
        elif n > self.max_model_len or n == self.max_model_len and not seq.prompt_only:
            error = f"prompt has {n} tokens; the model's context is {self.max_model_len}"
        elif (blocks := -(-(n + seq.max_tokens) // self.config.block_size)) > self.num_kv_blocks:
            error = self._too_few_blocks(seq, req, blocks)
        elif max(req.prompt_token_ids) >= self.model_config.vocab_size or min(req.prompt_token_ids) < 0:
            error = "prompt holds token ids outside the vocabulary"
        elif image_error := self._image_error(req):
            error = image_error
        elif any(not 0 <= t < self.model_config.vocab_size for t in req.params.logit_bias):
            error = "logit_bias holds token ids outside the vocabulary"
        elif req.lora is not None and req.lora not in (self.runner.lora.paths if self.runner.lora else {}):
            known = sorted(self.runner.lora.paths) if self.runner.lora else []
            error = f"unknown LoRA adapter {req.lora!r} " + (
                f"(engine.lora.adapters names {', '.join(map(repr, known))})" if known else "(engine.lora names none)"
            )
        elif req.lora is not None and req.lora in self.runner.lora.changed:
            error = self.runner.lora.changed[req.lora]
        elif req.first_token_alternatives and (
            req.params.prompt_logprobs is None
            or not all(0 <= t < self.model_config.vocab_size for t in req.first_token_alternatives)
        ):
            error = "first_token_alternatives: token ids inside the vocabulary, with prompt_logprobs"
        elif req.params.prompt_logprobs is not None and req.prompt_logprobs_start < 1:
            error = "nothing to score before the first token: it has no context (an empty prompt?)"
        elif req.params.n > self.config.max_num_seqs:
            error = f"n={req.params.n} samples exceed max_num_seqs {self.config.max_num_seqs}"
        else:
            try:
                seq.matcher = self.structured.matcher(req.params)
            except (RuntimeError, ValueError) as e:
                error = f"cannot compile the output constraint: {e}"
        if error:
            seq.finish_reason = "error"
            seq.metrics.finished_time = time.time()
            return self._output(seq, error)
        if seq.prompt_only and req.prompt_logprobs_start >= n:
            # No logprob is asked of any of its tokens (a one-token prompt: the first has none), and no token is
            # drawn: answered as a step would answer it, without one. Whether that scores enough is score_output's.
            seq.finish_reason, seq.status = "length", SequenceStatus.FINISHED
            seq.metrics.finished_time = time.time()
            return self._output(seq)
        if req.lora is not None:  # its blocks are keyed apart: K/V computed through an adapter are the adapter's
            seq.prefix_root = seq.last_block_hash = int(self.runner.lora.digests[req.lora][:16], 16)
        seq.after = self._in_flight.get(req.after) if req.after is not None else None
        self._in_flight[req.request_id] = seq
        self.scheduler.add(seq)
        return None

    def _too_few_blocks(self, seq: Sequence, req: Request, blocks: int) -> str:
        """Why a request cannot run: it needs more KV cache blocks than the pool holds (a scoring request, with
        max_tokens 0, in terms of what it scores: its prompt, or its prompt and the tokens scored after it)."""
        n, start, pool = seq.num_prompt_tokens, req.prompt_logprobs_start, self.num_kv_blocks
        if not seq.prompt_only:
            capped = f" ({seq.max_tokens} within the context)" if seq.max_tokens < req.params.max_tokens else ""
            return (
                f"prompt of {n} tokens plus max_tokens {req.params.max_tokens}{capped} needs more KV blocks "
                f"({blocks}) than the pool's {pool}"
            )
        scored = (
            f"prompt of {start} tokens plus {n - start} to score after it needs"
            if start > 1
            else f"{n} tokens to score need"
        )
        return (
            f"{scored} more KV cache blocks ({blocks} of {self.config.block_size} tokens) than the pool has ({pool}; "
            "raise engine.num_kv_blocks or the KV cache's memory)"
        )

    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        finished = self._fail_changed_adapters(sched) if self.runner.lora is not None else []
        if sched.scheduled:
            argmax = all(takes_argmax(seq) for seq, _ in sched.scheduled)
            prompt = prompt_logprob_rows(sched)
            # the rows' tokens with `argmax`, else their logits; and the prompt logprobs asked for, into `prompt`
            result = self.runner.execute(sched, argmax=argmax, prompt=prompt)
            if prompt is not None:
                prompt.assign()
            ready = self.scheduler.advance(sched)
            for seq in [s for s in ready if s.prompt_only]:  # scored: done with its prompt, no token to draw
                ready.remove(seq)
                self.scheduler.finish(seq, "length")
                finished.append(self._output(seq))
            seqs, rows = self._fork(ready)
            if len(rows) > result.shape[0]:  # new samples draw their first token from their root's row
                result = result[device_index(rows, result.device)]
            if argmax:
                tokens, logprobs = result.tolist(), [None] * len(seqs)
            elif seqs:
                # the grammars' masks are filled on the host while a GPU still runs the step
                mask = self.structured.fill(seqs, result.device)
                tokens, logprobs = self.sampler(result, seqs, mask)
            else:
                tokens, logprobs = [], []
            self.structured.accept(seqs, tokens)
            now = time.time()
            for seq, token, logprob in zip(seqs, tokens, logprobs):
                seq.token_ids.append(token)
                if logprob is not None:
                    seq.logprobs.append(logprob)
                if seq.metrics.first_token_time is None:
                    seq.metrics.first_token_time = now
                reason = self._check_stop(seq, token)
                if reason:
                    self.scheduler.finish(seq, reason)
                    output = self._group_output(seq)
                    if output is not None:
                        finished.append(output)
        self.step_count += 1
        self._report(sched, time.perf_counter() - t0)
        return finished

    def _fail_changed_adapters(self, sched: SchedulerOutput) -> list[RequestOutput]:
        """The step's adapters loaded into their slots; where one's folder changed since the engine read it, its
        requests, running and queued, finish with the reason (finish_reason "error") and the step goes on without
        them: the other adapters' rows and the base model's are not held up."""
        failed = self.runner.lora.load({seq.lora for seq, _ in sched.scheduled if seq.lora is not None})
        if not failed:
            return []
        kept = []
        for seq, n in sched.scheduled:
            if seq.lora not in failed:
                kept.append((seq, n))
            elif seq.is_prefill:
                sched.num_prefill_tokens -= n
            else:
                sched.num_decode_tokens -= n
        sched.scheduled = kept
        roots = {}
        for seq in [s for s in self.scheduler.running if s.lora in failed]:
            self.scheduler.finish(seq, "error")
            roots[id(seq.root)] = seq.root
        for seq in [s for s in self.scheduler.waiting if s.lora in failed]:
            self.scheduler.waiting.remove(seq)
            self.block_manager.free(seq)  # a preempted sample's, if it holds any
            seq.finish_reason = "error"
            roots[id(seq.root)] = seq.root
        return [self._output(root, failed[root.lora]) for root in roots.values()]

    def _fork(self, to_sample: list[Sequence]) -> tuple[list[Sequence], list[int]]:
        """A root about to draw its first token forks its other n-1 samples; returns the sequences to sample and
        the logits row of each."""
        seqs, rows = [], []
        for i, seq in enumerate(to_sample):
            seqs.append(seq)
            rows.append(i)
            while seq.needs_fork:
                child = seq.fork(len(seq.samples))
                child.matcher = self.structured.matcher(seq.params)  # compiled already, for the root
                self.scheduler.fork(seq, child)
                seqs.append(child)
                rows.append(i)
        return seqs, rows

    def _check_stop(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        searched = len(seq.text)  # the text earlier steps searched for stop strings
        seq.detokenize(self.tokenizer)
        if not p.ignore_eos and token in self.eos_token_ids or token in p.stop_token_ids:
            return "stop"
        if seq.matcher is not None and seq.matcher.is_terminated():
            return "stop"
        for s in p.stop:
            # A new match ends in this step's new text (of any length: one long token, or bytes held back until
            # they decode), so it starts at most len(s) - 1 characters before that text.
            idx = seq.text.find(s, max(0, searched - len(s) + 1))
            if idx >= 0:
                seq.text = seq.text[:idx]
                return "stop"
        if seq.num_output_tokens >= seq.max_tokens:
            return "length_capped" if seq.length_capped else "length"
        if seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _abort_in_flight(self) -> Iterator[RequestOutput]:
        for seq in list(self.scheduler.running):
            self.scheduler.finish(seq, "abort")
            output = self._group_output(seq)
            if output is not None:
                yield output
        yield from self._abort_waiting()

    def _drop_in_flight(self) -> None:
        """After a stream that ended early: its requests leave the engine and their KV blocks go back to the pool,
        so that a later stream neither runs them nor returns their outputs."""
        for seq in list(self.scheduler.running):
            self.scheduler.finish(seq, "abort")
        for seq in self.scheduler.waiting:  # none holds blocks, unless the step failed while admitting it
            self.block_manager.free(seq)
        self.scheduler.waiting.clear()
        self._in_flight.clear()

    def _abort_waiting(self) -> Iterator[RequestOutput]:
        """Requests none of whose samples is running; a preempted sample waits for its running siblings."""
        waiting, kept = self.scheduler.waiting, []
        while waiting:
            seq = waiting.popleft()
            if any(s.status is SequenceStatus.RUNNING for s in seq.root.samples):
                kept.append(seq)
                continue
            seq.finish_reason = "abort"
            output = self._group_output(seq)
            if output is not None:
                yield output
        waiting.extend(kept)

    def _group_output(self, seq: Sequence) -> RequestOutput | None:
        """The request's output once the last of its samples has finished."""
        root = seq.root
        if any(s.finish_reason is None for s in root.samples):
            return None
        return self._output(root)

    def _output(self, root: Sequence, error: str | None = None) -> RequestOutput:
        if self._in_flight.get(root.request_id) is root:
            del self._in_flight[root.request_id]
        samples = root.samples
        # A request with any sample aborted is not done: it runs again as a whole.
        reason = "abort" if any(s.finish_reason == "abort" for s in samples) else root.finish_reason
        root.metrics.finished_time = max(s.metrics.finished_time or 0.0 for s in samples) or None
        return RequestOutput(
            request_id=root.request_id,
            prompt_token_ids=root.prompt_token_ids,
            token_ids=root.output_token_ids,
            text=root.text,
            finish_reason=reason,
            num_cached_tokens=root.num_cached_tokens,
            logprobs=root.logprobs,
            prompt_logprobs=root.prompt_logprobs,
            alternative_logprobs=root.alternative_logprobs,
            error=error,
            metrics=root.metrics,
            outputs=[
                CompletionOutput(s.index, s.text, s.output_token_ids, s.finish_reason, s.logprobs) for s in samples
            ],
        )

    def _report(self, sched, step_time: float) -> None:
        s = self.scheduler
        budget = s.step_token_budget  # before the tuner sees this step and perhaps moves
        if s.auto_budget:
            s.auto_budget.observe(sched.num_batched_tokens, sched.num_prefill_tokens, step_time)
        m = StepMetrics(
            step=self.step_count,
            time=time.time(),
            step_time=step_time,
            num_seqs=len(sched.scheduled),
            num_prefill_tokens=sched.num_prefill_tokens,
            num_decode_tokens=sched.num_decode_tokens,
            kv_cache_usage=self.block_manager.usage,
            num_preemptions=sched.num_preempted,
            prefix_cache_queries=s.prefix_queries,
            prefix_cache_hits=s.prefix_hits,
            num_waiting=len(s.waiting),
            num_running=len(s.running),
            token_budget=budget,
        )
        self.last_step = m
        for fn in self._step_callbacks:
            fn(m)


def _per_prompt(lora: str | list[str | None] | None, n: int) -> list[str | None]:
    """generate()'s and score()'s `lora`: one name for every prompt, or one name (or None) per prompt."""
    if lora is None or isinstance(lora, str):
        return [lora] * n
    if len(lora) != n:
        raise ValueError(f"{n} prompts but {len(lora)} LoRA names: the lengths must be the same")
    return list(lora)
