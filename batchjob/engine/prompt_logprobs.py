"""Prompt logprobs (vLLM's `prompt_logprobs`): each prompt token's log-probability given the tokens before it, and
its k likeliest alternatives, taken in the step whose prefill chunk holds the row that predicts the token. Only those
rows' logits are materialised, and at most a step's worth of sampled rows at a time (max_num_seqs, the size the
runner's memory probe covers), so a long chunk never holds [chunk, vocab] logits at once."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from batchjob.engine.outputs import TokenLogprob
from batchjob.engine.scheduler import SchedulerOutput
from batchjob.engine.sequence import Sequence


@dataclass
class PromptLogprobRows:
    """The rows of one step whose logits give prompt logprobs, and after ModelRunner.execute their results."""

    rows: list[int] = field(default_factory=list)  # indices into the step's tokens
    targets: list[int] = field(default_factory=list)  # the prompt token each row predicts
    spans: list[tuple[Sequence, int, int]] = field(default_factory=list)  # (sequence, first token index, count)
    # then each sequence's first_token_alternatives, rows after the spans' (the row of its first scored token again)
    alternatives: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, count)
    k: int = 0  # the most alternatives any of the step's sequences asks for
    chosen: torch.Tensor | None = None  # [rows] float32, on the device until assign() reads it
    ranks: torch.Tensor | None = None  # [rows] int64, each prompt token's rank, on the device too
    top: tuple[torch.Tensor, torch.Tensor] | None = None  # [rows, k] values and token ids, when k

    def compute(self, hidden: torch.Tensor, model, slice_rows: int) -> None:
        """From the step's hidden states, left on the device: where no alternatives are asked for, the model's
        fused head where it has one (score_tokens: no logits written), else the float32 log-softmax of the rows'
        logits, a slice of rows at a time, each token's rank counted by the ops backend's count_greater."""
        rows = torch.tensor(self.rows, device=hidden.device)
        targets = torch.tensor(self.targets, device=hidden.device)
        if not self.k and (scored := model.score_tokens(hidden[rows], targets)) is not None:
            self.chosen, self.ranks = scored[0], scored[1] + 1
            return
        chosen, ranks, values, ids = [], [], [], []
        for i in range(0, len(self.rows), slice_rows):
            logprobs = model.compute_logits(hidden[rows[i : i + slice_rows]]).log_softmax(-1)
            picked = logprobs.gather(1, targets[i : i + slice_rows, None])
            chosen.append(picked.squeeze(1))
            ranks.append(model.ops.count_greater(logprobs, picked) + 1)
            if self.k:
                top = logprobs.topk(self.k, -1)
                values.append(top.values)
                ids.append(top.indices)
        self.chosen, self.ranks = torch.cat(chosen), torch.cat(ranks)
        if self.k:
            self.top = (torch.cat(values), torch.cat(ids))

    def assign(self) -> None:
        """Read by the host: each result into its sequence's prompt_logprobs, at the index of its token."""
        chosen, ranks = self.chosen.tolist(), self.ranks.tolist()
        values, ids = (self.top[0].tolist(), self.top[1].tolist()) if self.top is not None else ([], [])
        j = 0
        for seq, first, count in self.spans:
            k = seq.params.prompt_logprobs
            for idx in range(first, first + count):
                top = list(zip(ids[j][:k], values[j][:k])) if k else []
                seq.prompt_logprobs[idx] = TokenLogprob(self.targets[j], chosen[j], top, ranks[j])
                j += 1
        for seq, count in self.alternatives:
            k = seq.params.prompt_logprobs
            for idx in range(count):
                top = list(zip(ids[j][:k], values[j][:k])) if k else []
                seq.alternative_logprobs[idx] = TokenLogprob(self.targets[j], chosen[j], top, ranks[j])
                j += 1


def prompt_logprob_rows(out: SchedulerOutput) -> PromptLogprobRows | None:
    """The step's rows that predict a prompt token whose logprob was asked for; None when there are none."""
    plan = PromptLogprobRows()
    alt_rows, alt_targets = [], []
    offset = 0
    for seq, n in out.scheduled:
        if seq.params.prompt_logprobs is not None:
            start = seq.num_computed_tokens
            # position p's logits give token p + 1: positions from start - 1 up to the prompt's last but one
            first = max(start, seq.prompt_logprobs_start - 1)
            last = min(start + n, seq.num_prompt_tokens - 1)
            if last > first:
                plan.rows.extend(range(offset + first - start, offset + last - start))
                plan.targets.extend(seq.token_ids[first + 1 : last + 1])
                plan.spans.append((seq, first + 1, last - first))
                plan.k = max(plan.k, seq.params.prompt_logprobs)
                if first == seq.prompt_logprobs_start - 1 and (alts := seq.first_token_alternatives):
                    alt_rows.extend([offset + first - start] * len(alts))
                    alt_targets.extend(alts)
                    plan.alternatives.append((seq, len(alts)))
        offset += n
    plan.rows.extend(alt_rows)
    plan.targets.extend(alt_targets)
    return plan if plan.rows else None
