"""Matmuls on weights packed for oneDNN (model/matmul/linear.py) against F.linear, at the row counts steps take."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from batchjob.model.cpu_features import cpu_flags
from batchjob.model.matmul.linear import Linear


def _tensor(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("rows", [0, 1, 3, 17, 64, 300, 2048])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_matmul_matches_f_linear(rows, bias):
    w, b = _tensor(960, 576, seed=1), _tensor(960, seed=2) if bias else None
    lin = Linear(w.clone(), None if b is None else b.clone())
    assert lin.packed is not None and lin.backend == "onednn"
    x = _tensor(rows, 576, seed=3)
    torch.testing.assert_close(lin(x), F.linear(x, w, b), rtol=1e-5, atol=1e-4)
    assert lin(x.view(1, rows, 576)).shape == (1, rows, 960)  # leading dims kept


def test_the_unpacked_weight_is_let_go_unless_kept():
    w = _tensor(64, 32, seed=4)
    dropped, kept = Linear(w.clone()), Linear(w, keep_weight=True)
    assert dropped.weight.stride() == (0, 0) and dropped.shape == w.shape  # a stand-in with W's shape only
    assert kept.weight.data_ptr() == w.data_ptr()
    assert dropped.nbytes == kept.nbytes == w.numel() * 4


@pytest.mark.parametrize("rows", [1, 17, 300])
def test_bf16_weights_are_packed_and_match_f_linear(rows):
    """bf16 products summed in float32 and rounded once: within a bf16 rounding of the float32 product of the same
    bf16 values (a wrong layout or a bf16 accumulator would be far off)."""
    w, b = _tensor(1536, 576, seed=1).bfloat16(), _tensor(1536, seed=2).bfloat16()
    lin = Linear(w.clone(), b)
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        assert lin.packed is not None and lin.packed.dtype == torch.bfloat16
    else:  # a oneDNN without a bf16 GEMM: F.linear, the same numbers
        assert lin.packed is None
    x = _tensor(rows, 576, seed=3).bfloat16()
    out = lin(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), F.linear(x.float(), w.float(), b.float()), rtol=1e-2, atol=2e-2)
    assert lin.nbytes == (w.numel() + b.numel()) * 2


def test_other_dtypes_take_f_linear():
    w = _tensor(16, 8, seed=5).to(torch.float16)
    lin = Linear(w)
    x = _tensor(4, 8, seed=6).to(torch.float16)
    assert lin.packed is None
    assert torch.equal(lin(x), F.linear(x, w))


def test_a_onednn_that_cannot_pack_leaves_f_linear(monkeypatch, caplog):
    def refuse(weight, rows):
        raise RuntimeError("no inner product primitive")

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", refuse)
    w, x = _tensor(32, 16, seed=7), _tensor(5, 16, seed=8)
    lin = Linear(w)
    assert lin.packed is None and lin.backend == "torch" and lin.weight is w
    assert torch.equal(lin(x), F.linear(x, w))
    assert "cannot pack a (32, 16) weight" in caplog.text


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_alone_equals_the_row_in_a_batch(dtype):
    """Bit for bit, as batch invariance needs (a decode step of one sequence against one of many): oneDNN's one-row
    kernel sums otherwise than its batch kernels, which shows on the down projection's shape with a spread of
    magnitudes (some inputs x1000), so a single row is computed as two."""
    lin = Linear((_tensor(576, 1536, seed=9) * 0.05).to(dtype))
    for draw in range(20):
        x = _tensor(40, 1536, seed=100 + draw)
        x[:, draw::11] *= 1000
        x = x.to(dtype)
        batch = lin(x)
        assert torch.equal(lin(x[:1]), batch[:1]), draw
        assert torch.equal(lin(x[0]), batch[0]), draw  # a lone vector too


@pytest.mark.skipif(
    "amx_bf16" not in cpu_flags().split() or not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
    reason="oneDNN's AMX bf16 GEMM (whose sums change with the row count) runs only on a CPU with AMX",
)
def test_on_amx_a_rows_bf16_result_does_not_depend_on_the_calls_row_count():
    """oneDNN's AMX GEMM sums a row otherwise at 36 rows than at 37, at 255 than at 256 (the down projection's shape):
    rows go in blocks of 64 or of a wider size checked at load to sum as 64 do, so every row count gives each row
    what it gets alone. Without the blocks (row_blocks emptied) the same check fails."""
    lin = Linear((_tensor(576, 1536, seed=9) * 0.05).to(torch.bfloat16))
    assert lin.row_blocks[-1] == 64 and list(lin.row_blocks) == sorted(lin.row_blocks, reverse=True)
    x = _tensor(600, 1536, seed=11)
    x[:, 3::11] *= 1000
    x = x.to(torch.bfloat16)
    alone = torch.cat([lin(row) for row in x[:64]]).view(64, -1)

    def invariant() -> bool:
        return all(
            torch.equal(lin(x[:n])[: min(n, 64)], alone[: min(n, 64)])
            for n in (1, 2, 17, 36, 37, 64, 100, 255, 256, 300, 342, 600)
        )

    assert invariant()
    lin.row_blocks = ()
    assert not invariant()


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="oneDNN's bf16 GEMM (the packed path)")
@pytest.mark.parametrize("n", [1, 37, 100, 200])
def test_row_blocks_give_each_row_what_it_gets_alone_on_any_cpu(n):
    """The row-block path (AMX's, forced here on any CPU): 128-row blocks, then 64-row ones, the last padded, every
    row of the n in its place and none lost or doubled, each bit for bit what it gets alone. A bias rides along."""
    lin_weight = (_tensor(96, 160, seed=9) * 0.05).to(torch.bfloat16)
    lin = Linear(lin_weight, _tensor(96, seed=10).to(torch.bfloat16))
    assert lin.packed is not None
    lin.row_blocks = (128, 64)
    x = (_tensor(n, 160, seed=11) * torch.linspace(0.1, 10, n)[:, None]).to(torch.bfloat16)  # rows apart
    out = lin(x.view(1, n, 160))  # the leading dims kept
    assert out.shape == (1, n, 96)
    for i in range(n):
        assert torch.equal(out[0, i], lin(x[i])), i
    reference = F.linear(x.float(), lin_weight.float(), lin.bias.float())  # and each row its own product
    torch.testing.assert_close(out[0].float(), reference, rtol=2e-2, atol=2e-2 * reference.abs().max().item())
