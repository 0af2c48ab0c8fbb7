"""Steps without a scheduler: the caller picks which sequences run together and how many tokens each computes; the
engine's block manager, model runner and sampler do the rest. The bench's fixed-batch baseline drives it."""

from __future__ import annotations

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

    def release(self, seqs: list[Sequence]) -> None:
        for s in seqs:
            self._blocks.free(s)
