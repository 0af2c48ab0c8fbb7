"""Turns the logits of the rows that need a token into tokens, all rows of a step at once, on the logits' device.

Log-probabilities are of the model's own distribution (vLLM's raw_logprobs), taken before biases, penalties and any
grammar mask. Constrained rows are masked next; then every row's penalties, temperature and top-k / top-p / min-p
filters are applied as whole-batch tensor operations, greedy rows take the argmax and random rows draw from their
filtered distribution by its inverse: one uniform number u a row, the first token whose cumulative probability
passes u (a draw of one number a row, where the exponential race draws one a token: on a CPU that race cost more
than the forward pass). A row with a seed draws its u from its own generator, so that its tokens do not depend on the
batch; the other rows draw theirs in one call of the engine's generator.

`draw` never makes the host wait for the device: the per-row settings reach it in non-blocking copies from pinned
memory and every choice is a tensor operation, so on a GPU the host goes on (to the grammar masks, to the next
step's inputs) while the step runs; `Drawn.read` is the step's one copy back, of the tokens and the requested
logprobs together."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from batchjob.engine.host_sync import device_index, to_device
from batchjob.engine.outputs import TokenLogprob
from batchjob.engine.sequence import Sequence

LogitsMask = Callable[[torch.Tensor], None]  # masks rows of the step's logits in place
# Tokens a partial sort takes for top-p: the likeliest ones, which hold nearly all the mass of a language model's
# distribution; a row whose top_p they do not reach is sorted whole.
TOP_P_CANDIDATES = 1024


def _unbiased(seq: Sequence) -> bool:
    p = seq.params
    return p.repetition_penalty == 1.0 and not p.presence_penalty and not p.frequency_penalty and not p.logit_bias


def takes_argmax(seq: Sequence) -> bool:
    """A row whose token is its raw logits' argmax and nothing else of them is read: greedy, no bias or penalty, no
    logprobs, no grammar. A step of only such rows is sampled on the device (ModelRunner.execute's `argmax`)."""
    return seq.params.greedy and _unbiased(seq) and not seq.params.logprobs and seq.matcher is None


def _column(values: list, like: torch.Tensor) -> torch.Tensor:
    """Per-row values as a [rows, 1] tensor on the logits' device, to broadcast over the vocabulary."""
    return to_device(torch.tensor(values, dtype=like.dtype).unsqueeze(1), like.device)


def _token_matrix(rows: list[list[int]], like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's token ids padded to the longest (with id 0) as [rows, longest], and where a real id stands."""
    width = max(map(len, rows), default=0) or 1
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    real = torch.zeros(len(rows), width, dtype=torch.bool)
    for r, tokens in enumerate(rows):
        ids[r, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        real[r, : len(tokens)] = True
    return to_device(ids, like.device), to_device(real, like.device)


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """logit_bias, then repetition, presence and frequency penalties, in place on rows [len(seqs), V], each row with
    its own settings; rows without them are left as they are."""
    biased = [(r, t, v) for r, s in enumerate(seqs) for t, v in (s.params.logit_bias or {}).items()]
    if biased:
        rows, ids, values = zip(*biased)
        index = (device_index(rows, logits.device), device_index(ids, logits.device))
        logits.index_put_(index, to_device(torch.tensor(values, dtype=logits.dtype), logits.device), accumulate=True)
    repeat = [r for r, s in enumerate(seqs) if s.params.repetition_penalty != 1.0]
    if repeat:
        ids, real = _token_matrix([seqs[r].token_ids for r in repeat], logits)
        seen = torch.zeros(len(repeat), logits.shape[1], dtype=torch.bool, device=logits.device)
        seen.scatter_(1, ids, real)
        penalty = _column([seqs[r].params.repetition_penalty for r in repeat], logits)
        at = device_index(repeat, logits.device)
        rows = logits[at]
        penalized = torch.where(rows > 0, rows / penalty, rows * penalty)
        logits[at] = torch.where(seen, penalized, rows)
    counted = [r for r, s in enumerate(seqs) if (s.params.presence_penalty or s.params.frequency_penalty)]
    counted = [r for r in counted if seqs[r].output_token_ids]
    if counted:
        ids, real = _token_matrix([seqs[r].output_token_ids for r in counted], logits)
        counts = torch.zeros(len(counted), logits.shape[1], dtype=logits.dtype, device=logits.device)
        counts.scatter_add_(1, ids, real.to(logits.dtype))
        frequency = _column([seqs[r].params.frequency_penalty for r in counted], logits)
        presence = _column([seqs[r].params.presence_penalty for r in counted], logits)
        logits[device_index(counted, logits.device)] -= frequency * counts + presence * (counts > 0).to(logits.dtype)


def filter_probs(logits: torch.Tensor, top_k: list[int], top_p: list[float], min_p: list[float]) -> torch.Tensor:
    """The probabilities of rows [n, V] of temperature-scaled logits, zero where each row's top-k, top-p and min-p
    exclude a token (not renormalised). Top-k keeps ties with its k-th value; min-p and top-p are taken from the
    top-k filtered probabilities, top-p keeping the likeliest tokens whose preceding mass is below it (ties with
    the last kept one too)."""
    vocab = logits.shape[1]
    k = [min(v, vocab) if v else vocab for v in top_k]
    if min(k) < vocab:
        kth = logits.topk(max(k), dim=1).values.gather(1, device_index(k, logits.device).unsqueeze(1) - 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if max(min_p) == 0.0 and min(top_p) == 1.0:
        return probs
    floor = torch.zeros_like(probs[:, :1])
    if max(min_p) > 0.0:
        floor = _column(min_p, probs) * probs.max(-1, keepdim=True).values
    if min(top_p) < 1.0:
        floor = torch.maximum(floor, _top_p_floor(probs, _column(top_p, probs)))
    return probs.masked_fill_(probs < floor, 0.0)


def _top_p_floor(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Per row, the smallest probability top-p keeps. On a CPU found among the likeliest TOP_P_CANDIDATES tokens (a
    partial sort, where the mass almost always is; a whole sort costs more there than the forward pass), a row whose
    candidates hold less than its top_p sorted whole; on a GPU every row is sorted whole (a sort of the step's rows
    is cheap there, and learning which rows the candidates miss would make the host wait)."""

    def floor(sorted_vals: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        kept = (sorted_vals.cumsum(-1) - sorted_vals) < p  # the first is always kept
        return sorted_vals.gather(1, kept.sum(-1, keepdim=True) - 1)

    if probs.device.type != "cpu":
        return floor(probs.sort(dim=-1, descending=True).values, top_p)
    vals = probs.topk(min(TOP_P_CANDIDATES, probs.shape[1]), dim=1).values
    out = floor(vals, top_p)
    short = (vals.sum(-1, keepdim=True) < top_p).squeeze(1).nonzero().squeeze(1)
    if short.numel():
        out[short] = floor(probs[short].sort(dim=-1, descending=True).values, top_p[short])
    return out


@dataclass
class Drawn:
    """A step's tokens and the requested logprobs, still on the logits' device."""

    tokens: torch.Tensor  # [rows] int64
    want: list[int]  # the rows that asked for logprobs
    chosen: torch.Tensor | None = None  # [len(want)] the raw logprob of each one's token
    top_values: torch.Tensor | None = None  # [len(want), k] its k likeliest raw logprobs
    top_ids: torch.Tensor | None = None

    def read(self, seqs: list[Sequence]) -> tuple[list[int], list[TokenLogprob | None]]:
        """The host's one copy of the step's draws (float64 holds both token ids and float32 logprobs exactly)."""
        parts = [self.tokens]
        if self.want:
            parts += [self.chosen, self.top_values.flatten(), self.top_ids.flatten()]
        host = torch.cat([p.to(torch.float64) for p in parts]).cpu().tolist()
        n, w = len(self.tokens), len(self.want)
        tokens = [int(t) for t in host[:n]]
        logprobs: list[TokenLogprob | None] = [None] * n
        if self.want:
            k = self.top_ids.shape[1]
            chosen, top = host[n : n + w], host[n + w :]
            values, ids = top[: w * k], top[w * k :]
            for j, i in enumerate(self.want):
                m = seqs[i].params.top_logprobs
                pairs = [(int(ids[j * k + c]), values[j * k + c]) for c in range(m)]
                logprobs[i] = TokenLogprob(tokens[i], chosen[j], pairs)
        return tokens, logprobs


class Sampler:
    def __init__(self, seed: int = 0):
        self.generator = torch.Generator().manual_seed(seed)  # for requests without a seed

    def __call__(
        self, logits: torch.Tensor, seqs: list[Sequence], mask: LogitsMask | None = None
    ) -> tuple[list[int], list[TokenLogprob | None]]:
        """draw, then read: the tokens and, per row, its TokenLogprob when the row asks for logprobs, else None."""
        return self.draw(logits, seqs, mask).read(seqs)

    @torch.inference_mode()  # the logits are the model runner's inference tensors, changed in place here
    def draw(self, logits: torch.Tensor, seqs: list[Sequence], mask: LogitsMask | None = None) -> Drawn:
        """logits [N, V] float32, row i for seqs[i] (changed in place), on any device; `mask` masks the constrained
        rows in place. Nothing here waits for the device."""
        device = logits.device
        want = [i for i, seq in enumerate(seqs) if seq.params.logprobs]
        raw = logits[device_index(want, device)].log_softmax(-1) if want else None
        if mask is not None:
            mask(logits)
        plain = [i for i, seq in enumerate(seqs) if seq.params.greedy and _unbiased(seq)]
        rest = [i for i, seq in enumerate(seqs) if not (seq.params.greedy and _unbiased(seq))]
        if not rest:
            tokens = logits.argmax(-1)
        else:
            tokens = torch.zeros(len(seqs), dtype=torch.long, device=device)
            if plain:
                at = device_index(plain, device)
                tokens[at] = logits[at].argmax(-1)
            rows = logits if not plain else logits[device_index(rest, device)]  # the logits are the sampler's to change
            apply_penalties(rows, [seqs[i] for i in rest])
            greedy = [j for j, i in enumerate(rest) if seqs[i].params.greedy]
            if greedy:
                tokens[device_index([rest[j] for j in greedy], device)] = rows[device_index(greedy, device)].argmax(-1)
            random = [j for j, i in enumerate(rest) if not seqs[i].params.greedy]
            if random:
                chosen = rows if len(random) == len(rest) else rows[device_index(random, device)]
                drawn = self._sample(chosen, [seqs[rest[j]] for j in random])
                tokens[device_index([rest[j] for j in random], device)] = drawn
        if not want:
            return Drawn(tokens, want)
        chosen_ids = tokens[device_index(want, device)]
        k = max(seqs[i].params.top_logprobs for i in want)
        top_values, top_ids = raw.topk(k, -1)
        return Drawn(tokens, want, raw.gather(1, chosen_ids.unsqueeze(1)).squeeze(1), top_values, top_ids)

    def _sample(self, rows: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """One token a row of [n, V] penalized logits, each row at its own temperature and filters, drawn by the
        inverse of its distribution function: one uniform number a row, not one a token."""
        p = [s.params for s in seqs]
        probs = filter_probs(
            rows.div_(_column([q.temperature for q in p], rows)),
            [q.top_k for q in p],
            [q.top_p for q in p],
            [q.min_p for q in p],
        )
        uniform = torch.empty(len(seqs), 1)
        unseeded = [j for j, s in enumerate(seqs) if s.generator is None]
        if unseeded:
            uniform[unseeded] = torch.rand(len(unseeded), 1, generator=self.generator)
        for j, s in enumerate(seqs):
            if s.generator is not None:  # its own stream: the same draws whatever else is in the batch
                uniform[j] = torch.rand(1, generator=s.generator)
        cdf = probs.cumsum_(-1)
        # right=True: the first token whose cumulative mass passes the draw, which a zero-probability token never is
        picked = torch.searchsorted(cdf, to_device(uniform, cdf.device) * cdf[:, -1:], right=True)
        return picked.squeeze(1).clamp(max=probs.shape[1] - 1)
