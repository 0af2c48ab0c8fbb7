"""Steps without a scheduler: the caller picks which sequences run together and how many tokens each computes; the
engine's block manager, model runner and sampler do the rest. The bench's fixed-batch baseline drives it, and its
quality report scores given continuations with it."""

from __future__ import annotations

import torch

from batchjob.engine.block_manager import BlockManager
from batchjob.engine.model_runner import ModelRunner
from batchjob.engine.sampler import Sampler
from batchjob.engine.scheduler import SchedulerOutput
from batchjob.engine.sequence import Sequence


class StepRunner:
    def __init__(self, block_manager: BlockManager, runner: ModelRunner, sampler: Sampler):
        self._blocks, self._runner, self._sampler = block_manager, runner, sampler

    @property
    def num_free_blocks(self) -> int:
        return self._blocks.num_free_blocks

    @property
    def block_size(self) -> int:
        return self._blocks.block_size

    @property
    def kv_cache_usage(self) -> float:
        return self._blocks.usage

    def step(self, seqs: list[Sequence]) -> SchedulerOutput:
        """Every uncomputed token of each sequence in one step, then one sampled token appended to each."""
        sched = SchedulerOutput()
        for s in seqs:
            n = s.num_uncomputed_tokens
            self._blocks.allocate(s, n)
            sched.scheduled.append((s, n))
            if n > 1 or not s.num_computed_tokens:
                sched.num_prefill_tokens += n
            else:
                sched.num_decode_tokens += n
        tokens, _ = self._sampler(self._runner.execute(sched), seqs)
        for s, t in zip(seqs, tokens):
            s.num_computed_tokens = s.num_tokens
            s.token_ids.append(t)
        return sched

    def score(self, seq: Sequence, start: int) -> torch.Tensor:
        """Teacher forcing: every token of `seq` in one step (a prefill, through the KV cache), nothing sampled;
        the float32 log-probability of each token from `start` on given the tokens before it. Its blocks go back."""
        if not 0 < start < seq.num_tokens or seq.num_computed_tokens:
            raise ValueError(f"score: start {start} must fall within the {seq.num_tokens} uncomputed tokens, past 0")
        n = seq.num_tokens
        self._blocks.allocate(seq, n)
        try:
            sched = SchedulerOutput(scheduled=[(seq, n)], num_prefill_tokens=n)
            logits = self._runner.execute(sched, rows=list(range(start - 1, n - 1)))
        finally:
            self._blocks.free(seq)
        targets = torch.tensor(seq.token_ids[start:])
        return logits.log_softmax(-1).gather(1, targets[:, None]).squeeze(1)

    def release(self, seqs: list[Sequence]) -> None:
        for s in seqs:
            self._blocks.free(s)
