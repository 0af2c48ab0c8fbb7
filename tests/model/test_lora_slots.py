"""A step's LoRA updates (LoraBatch over LoraSlots) against each row's update computed alone, x @ A^T @ B^T, for
every way a step's rows fall: base rows, an adapter's rows side by side or scattered, groups large enough for their
own matmuls and small ones batched together, a step naming some of the slots or all of them in order."""

from pathlib import Path

import pytest
import torch

from batchjob.model import ops as ref
from batchjob.model.lora.slots import SMALL_GROUP, LoraBatch, LoraSlots
from batchjob.model.lora.weights import LoraAdapter, LoraUpdate

IN, OUT = 12, 10


def _adapter(name: str, rank: int, targets_qkv: bool, g: torch.Generator) -> LoraAdapter:
    def update(rank: int) -> LoraUpdate:
        return LoraUpdate(
            torch.randn(rank, IN, generator=g, dtype=torch.float64),
            torch.randn(OUT, rank, generator=g, dtype=torch.float64),
        )

    layer = {"o": update(rank + 1)}
    if targets_qkv:
        layer["qkv"] = update(rank)
    return LoraAdapter(name, Path(name), rank + 1, name, [layer])


def _reference(adapters, row_adapter, x, y, matmul):
    out = y.clone()
    for i, a in enumerate(row_adapter):
        update = None if a is None else adapters[a].layers[0].get(matmul)
        if update is not None:
            out[i] += x[i] @ update.a.T @ update.b.T
    return out


# Each step: (slot or None, token count) per sequence, in step order.
STEPS = {
    "small groups, every slot in order": [(0, 1), (0, 1), (1, 1), (2, 1), (2, 1), (None, 1)],
    "small groups, some slots, scattered": [(2, 3), (None, 2), (0, 1), (2, 1), (None, 4), (0, 5)],
    "a large group and small ones": [(None, 3), (1, SMALL_GROUP + 7), (0, 2), (2, 1), (0, 1)],
    "large groups alone, one scattered": [(1, SMALL_GROUP + 1), (None, 1), (1, 4), (2, 2 * SMALL_GROUP)],
    "one small group": [(None, 2), (2, 3)],
}


@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("matmul", ["qkv", "o"])
def test_lora_batch_equals_each_row_alone(step, matmul):
    g = torch.Generator().manual_seed(0)
    adapters = [_adapter("a", 2, True, g), _adapter("b", 5, False, g), _adapter("c", 3, True, g)]
    slots = LoraSlots(adapters, 3, torch.device("cpu"), torch.float64)
    for s, adapter in enumerate(adapters):
        slots.load(s, adapter)
    row_adapter = [s for s, n in STEPS[step] for _ in range(n)]
    x = torch.randn(len(row_adapter), IN, generator=g, dtype=torch.float64)
    y = torch.randn(len(row_adapter), OUT, generator=g, dtype=torch.float64)
    expected = _reference(adapters, row_adapter, x, y, matmul)
    batch = LoraBatch.build(slots, STEPS[step], torch.device("cpu"))
    torch.testing.assert_close(batch.add_to(0, matmul, x, y, ref), expected, rtol=1e-12, atol=1e-12)


def test_a_slot_reloaded_with_a_narrower_adapter_keeps_none_of_the_old_one():
    g = torch.Generator().manual_seed(1)
    wide, narrow = _adapter("wide", 5, True, g), _adapter("narrow", 1, False, g)
    slots = LoraSlots([wide, narrow], 1, torch.device("cpu"), torch.float64)
    slots.load(0, wide)
    slots.load(0, narrow)
    x, y = torch.randn(2, IN, generator=g, dtype=torch.float64), torch.zeros(2, OUT, dtype=torch.float64)
    batch = LoraBatch.build(slots, [(0, 2)], torch.device("cpu"))
    assert not batch.add_to(0, "qkv", x, y.clone(), ref).any()  # narrow targets no qkv: wide's must be gone
    expected = _reference([narrow], [0, 0], x, y, "o")
    torch.testing.assert_close(batch.add_to(0, "o", x, y, ref), expected, rtol=1e-12, atol=1e-12)
