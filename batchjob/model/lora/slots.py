"""Adapters on the device, stacked by slot (vLLM's and punica's layout): for each layer's fused matmul, a[slot] is an
adapter's shrink [in, rank] and b[slot] its expand [rank, out] with the scaling folded in, zero-padded to the largest
rank any configured adapter has there. A step's rows apply them in two ways (LoraBatch):

- an adapter with many rows in the step (a prefill chunk) runs its own shrink and expand on its rows, where the
  matmuls are large enough to pay for their calls;
- the adapters with few rows each (decodes) run together: their rows gathered into one [adapters, rows, in] batch
  padded to the longest, one batched shrink and one batched expand (punica's SGMV in two `bmm`s). Eight rank-8 adapters
  of 32 decode rows each cost 16 skinny matmul calls per projection one by one, three times the two `bmm`s."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from batchjob.model.lora.weights import LoraAdapter

# An adapter with at most this many rows in a step joins the batched matmuls of the other small groups.
SMALL_GROUP = 64


class LoraSlots:
    def __init__(self, adapters: Iterable[LoraAdapter], num_slots: int, device: torch.device, dtype: torch.dtype):
        """Room for `num_slots` adapters as wide as the widest of `adapters` on each matmul (zeros until loaded)."""
        shapes: dict[tuple[int, str], tuple[int, int, int]] = {}
        for adapter in adapters:
            for i, layer in enumerate(adapter.layers):
                for matmul, u in layer.items():
                    rank = max(u.a.shape[0], shapes.get((i, matmul), (0,))[0])
                    shapes[(i, matmul)] = (rank, u.a.shape[1], u.b.shape[0])
        self.a = {k: torch.zeros(num_slots, n_in, r, device=device, dtype=dtype) for k, (r, n_in, _) in shapes.items()}
        self.b = {k: torch.zeros(num_slots, r, out, device=device, dtype=dtype) for k, (r, _, out) in shapes.items()}
        self.num_slots = num_slots

    def load(self, slot: int, adapter: LoraAdapter) -> None:
        """Write `adapter` into `slot`, zeroing what it does not target."""
        for key, a in self.a.items():
            b, update = self.b[key], adapter.layers[key[0]].get(key[1])
            a[slot].zero_()
            b[slot].zero_()
            if update is not None:
                rank = update.a.shape[0]
                a[slot, :, :rank].copy_(update.a.T)
                b[slot, :rank].copy_(update.b.T)


@dataclass
class _Bundle:
    """The small groups' rows batched: x's rows gathered [groups * longest] (a short group padded by repeating one of
    its rows, whose outputs are never read), and where each of the bundle's rows (in step order) lies in the output."""

    slots: torch.Tensor | None  # the groups' slots; None: every slot, in order (the stacked weights as they are)
    gather: torch.Tensor
    longest: int
    pick: torch.Tensor
    rows: slice | torch.Tensor  # the bundle's rows in the step


@dataclass
class LoraBatch:
    """A step's adapters: the large groups' (slot, rows) one by one, the small groups as one bundle."""

    slots: LoraSlots
    large: list[tuple[int, slice | torch.Tensor]]
    bundle: _Bundle | None
    # The same rows as runs of one adapter, for a GPU kernel (punica's SGMV): [runs, 3] int32 of (first row, rows,
    # slot), and the longest run's length (the launch grid's size, a host value).
    segments: torch.Tensor
    longest_segment: int

    @classmethod
    def build(cls, slots: LoraSlots, row_slots: Iterable[tuple[int | None, int]], device: torch.device) -> LoraBatch:
        """From each scheduled sequence's slot (None for the base model) and token count, in step order."""
        spans: dict[int, list[int]] = {}
        runs: list[list[int]] = []
        total = 0
        for slot, n in row_slots:
            if slot is not None:
                spans.setdefault(slot, []).extend(range(total, total + n))
                if runs and runs[-1][2] == slot and sum(runs[-1][:2]) == total:
                    runs[-1][1] += n
                else:
                    runs.append([total, n, slot])
            total += n
        small = {s: rows for s, rows in spans.items() if len(rows) <= SMALL_GROUP}
        if len(small) < 2:  # nothing to batch
            small = {}
        large = [(s, _rows(rows, device)) for s, rows in spans.items() if s not in small]
        segments = torch.tensor(runs, dtype=torch.int32, device=device).view(-1, 3)
        longest = max((n for _, n, _ in runs), default=0)
        return cls(slots, large, _bundle(small, slots.num_slots, device) if small else None, segments, longest)

    def add_to(self, layer: int, matmul: str, x: torch.Tensor, y: torch.Tensor, ops) -> torch.Tensor:
        """y plus each row's adapter update for this layer's matmul (in place, by the backend's lora_add); y."""
        a, b = self.slots.a.get((layer, matmul)), self.slots.b.get((layer, matmul))
        if a is not None:  # else no adapter targets it
            ops.lora_add(x, y, a, b, self)
        return y


def lora_add(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, batch: LoraBatch) -> None:
    """y[rows] += x[rows] @ a[slot] @ b[slot] for each row of the batch with an adapter (the torch form): the large
    groups one by one, the small ones in two bmm."""
    for slot, rows in batch.large:
        if isinstance(rows, slice):
            y[rows].addmm_(x[rows] @ a[slot], b[slot])
        else:
            y.index_add_(0, rows, (x.index_select(0, rows) @ a[slot]) @ b[slot])
    g = batch.bundle
    if g is not None:
        if g.slots is not None:
            a, b = a.index_select(0, g.slots), b.index_select(0, g.slots)
        xs = x.index_select(0, g.gather).view(a.shape[0], g.longest, x.shape[1])
        out = torch.bmm(torch.bmm(xs, a), b).view(-1, y.shape[1]).index_select(0, g.pick)
        if isinstance(g.rows, slice):
            y[g.rows].add_(out)
        else:
            y.index_add_(0, g.rows, out)


def _rows(rows: list[int], device: torch.device) -> slice | torch.Tensor:
    """Ascending row indices as a slice where they are consecutive (the scheduler groups a step's rows by adapter)."""
    if rows[-1] - rows[0] + 1 == len(rows):
        return slice(rows[0], rows[-1] + 1)
    return torch.tensor(rows, dtype=torch.int64, device=device)


def _bundle(groups: dict[int, list[int]], num_slots: int, device: torch.device) -> _Bundle:
    order = sorted(groups)
    longest = max(len(rows) for rows in groups.values())
    gather = [r for s in order for r in groups[s] + [groups[s][0]] * (longest - len(groups[s]))]
    where = {r: i * longest + j for i, s in enumerate(order) for j, r in enumerate(groups[s])}
    rows = sorted(where)
    slots = None if order == list(range(num_slots)) else torch.tensor(order, dtype=torch.int64, device=device)
    return _Bundle(
        slots,
        torch.tensor(gather, dtype=torch.int64, device=device),
        longest,
        torch.tensor([where[r] for r in rows], dtype=torch.int64, device=device),
        _rows(rows, device),
    )
