"""One request's state as the scheduler and runner see it."""

from __future__ import annotations

import enum
import time

import torch

from batchjob.engine.outputs import Request, RequestMetrics, TokenLogprob


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, request: Request, arrival_index: int):
        self.request_id = request.request_id
        self.params = request.params
        self.prompt_token_ids = list(request.prompt_token_ids)
        self.token_ids = list(request.prompt_token_ids)  # prompt + output
        self.arrival_index = arrival_index  # admission order, for FCFS and the `newest` preemption victim
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.block_table: list[int] = []
        self.num_hashed_blocks = 0  # leading blocks already keyed in the prefix cache
        self.last_block_hash: int | None = None
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache at first admission
        self.max_tokens = self.params.max_tokens  # may be lowered by elastic compression
        self.length_capped = False
        self.finish_reason: str | None = None
        self.logprobs: list[TokenLogprob] | None = [] if self.params.logprobs else None
        self.prompt_logprobs_start = request.prompt_logprobs_start
        self.lora = request.lora
        self.images = request.images
        self.image_features: torch.Tensor | None = None  # [image tokens, hidden], computed at its first image chunk
        # The prefix cache's root for this sequence's blocks: an adapter's K/V are its own (set by the engine).
        self.prefix_root: int | None = None
        # By position, so that a prompt computed again after a preemption writes the same entries again.
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * len(self.prompt_token_ids)
        self.first_token_alternatives = list(request.first_token_alternatives)
        self.alternative_logprobs: list[TokenLogprob | None] | None = None
        if self.first_token_alternatives:
            self.alternative_logprobs = [None] * len(self.first_token_alternatives)
        self.after: Sequence | None = None  # admitted once this one has computed the shared prefix (Request.after)
        self.matcher = None  # xgrammar's GrammarMatcher when the output is constrained
        # n samples: the first sequence (index 0) is the root; at its first token it forks the others.
        self.index = 0
        self.root = self
        self.samples: list[Sequence] = [self]
        self.metrics = RequestMetrics(arrival_time=time.time())
        self.skipped = 0  # times a later request was admitted ahead of this one (bounded bypass)
        self.generator: torch.Generator | None = None
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)
        # Incremental detokenization state.
        self.text = ""
        self.prefix_offset = 0
        self.read_offset = len(self.prompt_token_ids)

    def fork(self, index: int) -> Sequence:
        """Sample `index` of this root, at the point where the prompt is computed and no token drawn yet: it shares
        the prompt's KV blocks (BlockManager.fork) and draws its own tokens (seed + index when seeded)."""
        child = Sequence(
            Request(self.request_id, self.prompt_token_ids, self.params, lora=self.lora, images=self.images),
            self.arrival_index,
        )
        child.image_features = self.image_features  # the partial block it computes again may hold image tokens
        child.prefix_root = self.prefix_root
        child.index, child.root = index, self
        child.max_tokens, child.length_capped = self.max_tokens, self.length_capped  # as capped at admission
        if self.params.seed is not None:
            child.generator = torch.Generator().manual_seed(self.params.seed + index)
        child.metrics.arrival_time = self.metrics.arrival_time
        child.metrics.first_scheduled_time = self.metrics.first_scheduled_time
        child.num_cached_tokens = self.num_cached_tokens
        self.samples.append(child)
        return child

    def block_key(self, start: int, block_size: int) -> tuple:
        """What keys the block of tokens [start, start + block_size) in the prefix cache: its tokens, and the
        digest of each image whose first token lies in it (chained on by the blocks after it), so that two images
        behind the same placeholder tokens never share K/V."""
        tokens = tuple(self.token_ids[start : start + block_size])
        if self.images is None:
            return tokens
        images = self.images
        digests = tuple(d for s, d in zip(images.image_starts, images.digests) if start <= s < start + block_size)
        return (tokens, digests) if digests else tokens

    @property
    def needs_fork(self) -> bool:
        return self.root is self and self.params.n > len(self.samples)

    @property
    def prompt_only(self) -> bool:
        """Scoring work (max_tokens 0): its prompt is computed for its prompt logprobs, and no token is drawn."""
        return self.params.max_tokens == 0

    @property
    def prefix_cache_limit(self) -> int:
        """The most leading tokens the prefix cache may serve: never the last (its logits give the next token), nor
        any whose logits give a prompt logprob asked for."""
        if self.params.prompt_logprobs is not None:
            return self.prompt_logprobs_start - 1
        return self.num_tokens - 1

    @property
    def waits_for_prefix(self) -> bool:
        """Its Request.after has not yet computed the prefix this one would read from the cache."""
        lead = self.after
        return lead is not None and lead.finish_reason is None and lead.num_computed_tokens < self.prefix_cache_limit

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        """More than one token to compute: a (possibly resumed) prompt, not a decode; or any of a prompt that draws
        no token (its last may come alone, after a prefix-cache hit or a chunk)."""
        return self.num_uncomputed_tokens > 1 or self.prompt_only

    @property
    def remaining_tokens(self) -> int:
        return self.max_tokens - self.num_output_tokens

    def detokenize(self, tokenizer) -> None:
        """Extend `text` by the newest tokens. Incremental, safe across multi-byte characters split over tokens:
        text is only emitted once the bytes decode without a replacement character."""
        ids = self.token_ids
        prefix = tokenizer.decode(ids[self.prefix_offset : self.read_offset])
        full = tokenizer.decode(ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(ids)

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={len(self.block_table)})"
        )
