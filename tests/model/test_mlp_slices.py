"""A long CPU step's MLP in slices of rows (LlamaModel.mlp): its largest activations exist for a slice at a time, and
its results are the same bits as the whole step's in every numerics path."""

from __future__ import annotations

import pytest
import torch

from batchjob.model import llama
from tests.model.test_arithmetic import decoder


@pytest.mark.parametrize(("dtype", "w8a8"), [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True)])
def test_a_long_steps_mlp_runs_in_slices_of_rows_with_the_same_bits(dtype, w8a8, monkeypatch):
    model = decoder(dtype, w8a8)
    rows = 2 * llama.MLP_SLICE_ROWS + 276
    x = torch.randn(rows, model.config.hidden_size, generator=torch.Generator().manual_seed(0)).to(dtype)
    layer = model.layers[1]
    gate_up, seen = layer["gate_up"], []
    layer["gate_up"] = lambda t: seen.append(t.shape[0]) or gate_up(t)
    sliced = model.mlp(1, x, None)
    assert seen == [llama.MLP_SLICE_ROWS, llama.MLP_SLICE_ROWS, 276]  # never [rows, 2 x intermediate] at once
    monkeypatch.setattr(llama, "MLP_SLICE_ROWS", rows)
    whole = model.mlp(1, x, None)
    assert seen[-1] == rows
    assert torch.equal(sliced, whole)
