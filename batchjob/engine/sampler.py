"""Turns the logits of the rows that need a token into tokens.

Log-probabilities are of the model's own distribution (vLLM's raw_logprobs), taken before biases, penalties and any
grammar mask. Constrained rows are masked next; then greedy rows take a batched argmax. Random rows sample by the
exponential race (argmax of p / E, E ~ Exp(1)), drawing E from the request's own generator when it has a seed, so
that its tokens do not depend on the batch."""

from __future__ import annotations

from collections.abc import Callable

import torch

from batchjob.engine.outputs import TokenLogprob
from batchjob.engine.sequence import Sequence

LogitsMask = Callable[[torch.Tensor, list[Sequence]], None]  # masks rows of the logits in place


def _apply_penalties(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    p = seq.params
    if p.logit_bias:
        ids = torch.tensor(list(p.logit_bias), dtype=torch.long)
        logits[ids] += torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype)
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(seq.token_ids)), dtype=torch.long)
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if p.presence_penalty or p.frequency_penalty:
        out = seq.output_token_ids
        if out:
            ids, counts = torch.tensor(out, dtype=torch.long).unique(return_counts=True)
            logits[ids] -= p.frequency_penalty * counts.to(logits.dtype) + p.presence_penalty
    return logits


def _unbiased(seq: Sequence) -> bool:
    p = seq.params
    return p.repetition_penalty == 1.0 and not p.presence_penalty and not p.frequency_penalty and not p.logit_bias


def takes_argmax(seq: Sequence) -> bool:
    """A row whose token is its raw logits' argmax and nothing else of them is read: greedy, no bias or penalty, no
    logprobs, no grammar. A step of only such rows is sampled on the device (ModelRunner.execute's `argmax`)."""
    return seq.params.greedy and _unbiased(seq) and not seq.params.logprobs and seq.matcher is None


def _filter(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Mask out what top-k, top-p and min-p exclude (logits already divided by temperature)."""
    if top_k and top_k < logits.numel():
        kth = logits.topk(top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0 or min_p > 0.0:
        probs = logits.softmax(-1)
        if min_p > 0.0:
            logits = logits.masked_fill(probs < min_p * probs.max(), float("-inf"))
        if top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            # Keep each token whose preceding mass is below top_p (the first is always kept).
            drop = (sorted_probs.cumsum(-1) - sorted_probs) >= top_p
            logits = logits.index_fill(0, order[drop], float("-inf"))
    return logits


class Sampler:
    def __init__(self, seed: int = 0):
        self.generator = torch.Generator().manual_seed(seed)  # for requests without a seed

    def __call__(
        self, logits: torch.Tensor, seqs: list[Sequence], mask: LogitsMask | None = None
    ) -> tuple[list[int], list[TokenLogprob | None]]:
        """logits [N, V] float32 on the CPU, row i for seqs[i] (changed in place). Returns the tokens and, per row,
        its TokenLogprob when the row asks for logprobs, else None."""
        want = [i for i, seq in enumerate(seqs) if seq.params.logprobs]
        raw = logits[want].log_softmax(-1) if want else None
        if mask is not None:
            mask(logits, seqs)
        tokens = logits.argmax(-1).tolist()
        for i, seq in enumerate(seqs):
            p = seq.params
            if p.greedy and _unbiased(seq):
                continue
            row = _apply_penalties(logits[i].clone(), seq)
            if p.greedy:
                tokens[i] = int(row.argmax())
                continue
            row = _filter(row / p.temperature, p.top_k, p.top_p, p.min_p)
            race = torch.empty_like(row).exponential_(generator=seq.generator or self.generator)
            tokens[i] = int((row.softmax(-1) / race).argmax())
        logprobs: list[TokenLogprob | None] = [None] * len(seqs)
        if want:
            chosen = raw.gather(1, torch.tensor([tokens[i] for i in want]).unsqueeze(1)).squeeze(1).tolist()
            k = max(seqs[i].params.top_logprobs for i in want)
            top_vals, top_ids = raw.topk(k, -1) if k else (None, None)
            for j, i in enumerate(want):
                n = seqs[i].params.top_logprobs
                top = list(zip(top_ids[j, :n].tolist(), top_vals[j, :n].tolist())) if n else []
                logprobs[i] = TokenLogprob(tokens[i], chosen[j], top)
        return tokens, logprobs
