"""`max_num_batched_tokens: auto`: the step's token budget, tuned while the engine runs.

A step costs a fixed part (Python, kernel launches, the sampler) plus a part that grows with its tokens: linearly
while the hardware has idle units, faster than linearly once activations fall out of cache or attention over long
chunks dominates. Tokens per second therefore rise with the budget up to a knee and are flat or falling past it,
where a bigger budget only costs latency and activation memory. The tuner walks a ladder of budgets (doubling from
MIN_BUDGET to a cap the engine derives from its memory) by comparing two neighbouring levels at a time, and settles
at the smallest budget whose next level up gains less than GAIN. After REPROBE_SAMPLES steps it compares the
neighbours again: prompt lengths, batch sizes and the machine's load change during a long job.

The two levels of a comparison take turns step by step, so that a change in the machine's speed (other processes on
a shared host, clocks) hits both alike instead of passing for a difference between them. Only steps that carry
prefill and fill the budget are measured: a decode-only step is as large as the number of running sequences whatever
the budget, and a step short of work says nothing about the budget."""

from __future__ import annotations

import statistics

MIN_BUDGET = 128
MAX_BUDGET = 16384
GAIN = 0.03  # a bigger budget must buy at least this much more throughput
SAMPLES = 4  # measured steps per level and comparison; their median resists a stray slow step
FULL = 0.9  # a step is limited by the budget when it carries at least this share of it
REPROBE_SAMPLES = 500


def budget_cap(max_num_seqs: int, max_model_len: int, kv_pool_tokens: int | None = None) -> int:
    """The largest budget worth trying: one that can fill (every sequence's whole context in one step at most), and
    no more than a quarter of the KV pool, so that one step of prefill cannot fill the pool and force preemptions."""
    cap = min(MAX_BUDGET, max_num_seqs * max_model_len)
    if kv_pool_tokens is not None:
        cap = min(cap, kv_pool_tokens // 4)
    return max(16, cap)


class AutoTokenBudget:
    def __init__(self, cap: int, start: int):
        """Levels from MIN_BUDGET (or the cap, if lower) doubling up to `cap`; it begins at the one at or below
        `start` (the profile's fixed budget, so that tuning starts from the untuned default)."""
        self.levels = [min(MIN_BUDGET, cap)]
        while self.levels[-1] * 2 <= cap:
            self.levels.append(self.levels[-1] * 2)
        self.index = max(i for i, level in enumerate(self.levels) if level <= max(start, self.levels[0]))
        self.rates: dict[int, float] = {}  # budget -> tokens/s at its latest comparison, for the report
        self.moves = 0
        self.pair: tuple[int, int] | None = None  # (lower, upper) level indexes being compared
        self.turn = 0  # which of the pair runs the next step
        self.samples: tuple[list[float], list[float]] = ([], [])
        self.upward = True  # a round compares upward first; downward only when its first step up did not pay
        self.first = True  # the round's first comparison
        self.settled_samples = 0
        self._start_round()

    @property
    def value(self) -> int:
        return self.levels[self.pair[self.turn] if self.pair else self.index]

    @property
    def chosen(self) -> int:
        """The budget it holds to be best so far (while comparing, `value` alternates around it)."""
        return self.levels[self.index]

    @property
    def settled(self) -> bool:
        return self.pair is None

    def observe(self, batched_tokens: int, prefill_tokens: int, step_time: float) -> None:
        """After each step, which the budget `value` scheduled."""
        measured = prefill_tokens > 0 and batched_tokens >= FULL * self.value and step_time > 0
        if self.pair is None:
            self.settled_samples += measured
            if self.settled_samples >= REPROBE_SAMPLES:
                self._start_round()
            return
        if measured:
            self.samples[self.turn].append(batched_tokens / step_time)
        self.turn = 1 - self.turn
        if all(len(s) >= SAMPLES for s in self.samples):
            lower, upper = (statistics.median(s) for s in self.samples)
            self.rates[self.levels[self.pair[0]]], self.rates[self.levels[self.pair[1]]] = lower, upper
            self._decide(*self.pair, pays=upper >= lower * (1 + GAIN))

    def _start_round(self) -> None:
        self.upward, self.first = True, True
        if self.index + 1 < len(self.levels):
            self._compare(self.index, self.index + 1)
        elif self.index > 0:
            self.upward = False
            self._compare(self.index - 1, self.index)
        else:
            self._settle(self.index)

    def _decide(self, lo: int, hi: int, pays: bool) -> None:
        first, self.first = self.first, False
        if self.upward and pays:
            self._go(hi)
            if hi + 1 < len(self.levels):
                self._compare(hi, hi + 1)
            else:
                self._settle(hi)
        elif self.upward and first and lo > 0:  # the round's start may be past the knee already: look below
            self.upward = False
            self._compare(lo - 1, lo)
        elif self.upward or pays:
            self._settle(hi if pays else lo)
        else:  # downward, and the upper level buys too little: go on down
            self._go(lo)
            if lo > 0:
                self._compare(lo - 1, lo)
            else:
                self._settle(lo)

    def _compare(self, lo: int, hi: int) -> None:
        self.pair, self.turn, self.samples = (lo, hi), 0, ([], [])

    def _go(self, i: int) -> None:
        if i != self.index:
            self.index = i
            self.moves += 1

    def _settle(self, i: int) -> None:
        self._go(i)
        self.pair, self.settled_samples = None, 0

    def summary(self) -> dict:
        return {
            "budget": self.chosen,
            "settled": self.settled,
            "moves": self.moves,
            "tokens_per_s_by_budget": {level: round(rate, 1) for level, rate in sorted(self.rates.items())},
        }
