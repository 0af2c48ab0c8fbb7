"""Continuous batching: every step refills the batch inside the token budget and the KV pool.

Order within a step: running decodes and partial prefills (oldest first), then new requests from the queue.
Memory has three layers: a hard cap (a request waits when blocks are short), a soft watermark (no new prefills
above it), and preemption by recompute as the last resort; the recent preemption rate lowers the watermark. A request
held back by either limit lets smaller ones behind it go first, at most `max_bypass` of them (then it goes next)."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from itertools import islice

from batchjob.engine.block_manager import BlockManager
from batchjob.engine.config import EngineConfig
from batchjob.engine.sequence import Sequence, SequenceStatus
from batchjob.engine.token_budget import AutoTokenBudget

_THROTTLE_STEP, _THROTTLE_DECAY, _THROTTLE_MAX = 0.02, 0.01, 0.5
_SUSTAINED_PRESSURE_STEPS = 20
_MAX_LOOKAHEAD = 32  # requests one step may pass over while looking for one that fits
# A prefill chunk that is not its prompt's last ends at a multiple of this many positions: the CPU attention computes
# query rows in tiles of 16 from the chunk's start, by other arithmetic in a tile of a few rows than in a full one,
# so chunks cut anywhere would make a row's numbers depend on how its prompt was split (in bf16 enough to flip a
# greedy token). Cut on this grid, every tile of a prompt holds the same rows however it is split or batched.
PREFILL_CHUNK_ALIGN = 16


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, tokens to compute)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_preempted: int = 0

    @property
    def num_batched_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, auto_budget: AutoTokenBudget | None = None):
        self.config, self.bm = config, block_manager
        self.auto_budget = auto_budget  # set when max_num_batched_tokens is "auto"
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # oldest admission first
        self.preemption_history: deque[int] = deque(maxlen=100)
        self.num_preemptions_total = 0
        self.throttle = 0.0  # subtracted from kv_watermark while preemptions are frequent
        self.pressure_steps = 0
        self.prefix_queries = self.prefix_hits = 0  # prompt tokens looked up / found, at first admission

    def reset_prefix_stats(self) -> None:
        self.prefix_queries = self.prefix_hits = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def preemption_rate(self) -> float:
        """Preemptions per 100 steps, over the last 100 steps."""
        h = self.preemption_history
        return 100.0 * sum(h) / len(h) if h else 0.0

    @property
    def effective_watermark(self) -> float:
        return max(0.05, self.config.kv_watermark - self.throttle)

    @property
    def step_token_budget(self) -> int:
        """The next step's budget: the fixed one, or the level the tuner is trying now (Engine.token_budget is
        the tuner's best so far)."""
        return self.auto_budget.value if self.auto_budget else self.config.max_num_batched_tokens

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.step_token_budget
        scheduled: set[int] = set()
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted earlier in this loop
                continue
            n = self._fit(seq, min(seq.num_uncomputed_tokens, budget))
            while n == 0:
                victim = self._choose_victim(seq, scheduled)
                self._preempt(victim)
                out.num_preempted += 1
                if victim is seq:
                    break
                n = self._fit(seq, min(seq.num_uncomputed_tokens, budget))
            n = self._align(seq, n)
            if n == 0:
                continue
            self._schedule(seq, n, out)
            scheduled.add(id(seq))
            budget -= n
        if out.num_preempted == 0:  # a step that preempted has no room to admit
            self._admit(budget, out)
        if self.config.lora is not None:  # each adapter's rows side by side: its update is one matmul on a slice
            out.scheduled.sort(key=lambda item: item[0].lora or "")
        self._update_pressure(out.num_preempted)
        return out

    @staticmethod
    def _align(seq: Sequence, n: int) -> int:
        """n tokens of `seq`, fewer if needed so that a chunk short of the prompt's end ends on the
        PREFILL_CHUNK_ALIGN grid (unchanged where that would leave none)."""
        if n >= seq.num_uncomputed_tokens:
            return n
        end = seq.num_computed_tokens + n
        aligned = end - end % PREFILL_CHUNK_ALIGN
        return aligned - seq.num_computed_tokens if aligned > seq.num_computed_tokens else n

    def _fit(self, seq: Sequence, n: int) -> int:
        """The most of `n` tokens of `seq` that the free blocks hold."""
        free_slots = len(seq.block_table) * self.bm.block_size - seq.num_computed_tokens
        free_slots += self.bm.num_free_blocks * self.bm.block_size
        return max(0, min(n, free_slots))

    def _schedule(self, seq: Sequence, n: int, out: SchedulerOutput) -> None:
        self.bm.allocate(seq, n)
        out.scheduled.append((seq, n))
        if seq.is_prefill:
            out.num_prefill_tokens += n
        else:
            out.num_decode_tokens += n

    def _admit(self, budget: int, out: SchedulerOutput) -> None:
        cfg, bm = self.config, self.bm
        blocked: list[Sequence] = []  # requests passed over in this step because they did not fit
        # A root that will fork holds a seat for each of its samples.
        seats = sum(s.params.n if s.needs_fork else 1 for s in self.running)
        candidates = islice(self.waiting, cfg.max_num_seqs - len(self.running) + _MAX_LOOKAHEAD)
        # the rows of at most max_loras adapters run at once: each has its slot (lora/manager.py)
        loras = {s.lora for s in self.running if s.lora is not None}
        for seq in list(candidates):
            need_seats = seq.params.n if seq.needs_fork else 1
            if budget == 0 or seats + need_seats > cfg.max_num_seqs:
                break
            if any(b.skipped >= cfg.max_bypass for b in blocked):
                break  # bounded bypass: the passed-over request gets the next free blocks
            if len(blocked) >= _MAX_LOOKAHEAD:
                break  # memory is short for most of the queue: scanning all of it every step costs O(queue)
            if seq.waits_for_prefix:
                continue  # its shared prefix is computed in this or a coming step by the request it follows
            if seq.lora is not None and seq.lora not in loras and len(loras) >= cfg.lora.max_loras:
                continue  # its adapter's turn comes when one of the running adapters has no rows left
            cached = bm.match_prefix(seq)
            n = min(seq.num_uncomputed_tokens, budget)
            need = bm.blocks_needed(seq, n)
            # Soft watermark: no first chunk that lifts usage above it while others run, so that their decodes have
            # room to grow. Hard cap: not even a useful first chunk fits in the free blocks. Either way a smaller
            # request behind it may still go first, a bounded number of times.
            over_watermark = self.running and (bm.num_used_blocks + need) / bm.num_blocks > self.effective_watermark
            n = 0 if over_watermark else self._align(seq, self._fit(seq, n))
            if n < min(seq.num_uncomputed_tokens, bm.block_size):
                bm.free(seq)
                blocked.append(seq)
                continue
            for b in blocked:
                b.skipped += 1
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            seats += need_seats
            if seq.lora is not None:
                loras.add(seq.lora)
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = time.time()
                seq.num_cached_tokens = cached
                self.prefix_queries += seq.num_tokens
                self.prefix_hits += cached
            self._schedule(seq, n, out)
            budget -= n

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """A running parent's new sample runs beside it, on the parent's prompt blocks (counted as prefix hits)."""
        shared = self.bm.fork(parent, child)
        child.status = SequenceStatus.RUNNING
        self.running.append(child)
        self.prefix_queries += parent.num_prompt_tokens
        self.prefix_hits += shared

    def _choose_victim(self, seq: Sequence, scheduled: set[int]) -> Sequence:
        """Never the oldest running sequence while others exist (so that it always progresses), nor one already
        scheduled in this step; `seq` itself when nothing else qualifies."""
        candidates = [s for s in self.running[1:] if id(s) not in scheduled and s is not seq]
        if seq is not self.running[0]:
            candidates.append(seq)
        if not candidates:
            return seq
        if self.config.preemption_policy == "longest_remaining":
            return max(candidates, key=lambda s: (s.remaining_tokens, s.arrival_index))
        return max(candidates, key=lambda s: s.arrival_index)

    def _preempt(self, seq: Sequence) -> None:
        """Recompute: drop its blocks (full ones stay in the prefix cache) and put it first in the queue."""
        self.bm.free(seq)
        self.running.remove(seq)
        seq.status = SequenceStatus.WAITING
        seq.metrics.num_preemptions += 1
        self.waiting.appendleft(seq)
        self.num_preemptions_total += 1

    def _update_pressure(self, num_preempted: int) -> None:
        self.preemption_history.append(num_preempted)
        if self.preemption_rate > self.config.preemption_rate_threshold:
            self.throttle = min(_THROTTLE_MAX, self.throttle + _THROTTLE_STEP)
            self.pressure_steps += 1
        else:
            self.throttle = max(0.0, self.throttle - _THROTTLE_DECAY)
            self.pressure_steps = 0
        if self.config.elastic_compression and self.pressure_steps >= _SUSTAINED_PRESSURE_STEPS:
            floor = self.config.elastic_max_tokens_floor
            for seq in self.waiting:
                if seq.metrics.first_scheduled_time is None and seq.max_tokens > floor:
                    seq.max_tokens, seq.length_capped = floor, True

    def advance(self, out: SchedulerOutput) -> list[Sequence]:
        """After the step's forward pass: its tokens are in the cache. Returns the sequences that now need their
        next token (all their tokens computed), in scheduled order."""
        ready = []
        for seq, n in out.scheduled:
            seq.num_computed_tokens += n
            self.bm.commit_full_blocks(seq)
            if seq.num_computed_tokens == seq.num_tokens:
                ready.append(seq)
        return ready

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        seq.status = SequenceStatus.FINISHED
        seq.metrics.finished_time = time.time()
        self.bm.free(seq)
        self.running.remove(seq)
