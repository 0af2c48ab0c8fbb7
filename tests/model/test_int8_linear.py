"""W8A8 matmuls (model/matmul/int8_linear.py): the product of the quantized operands, exactly; within the bound that
quantization allows of the float matmul; a row's result independent of its batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from batchjob.model.matmul import int8_linear
from batchjob.model.matmul.int8_linear import (
    QMAX,
    QMAX_WITHOUT_VNNI,
    Int8Linear,
    quantize_rows,
    quantize_rows_torch,
    quantize_weight,
)

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="oneDNN's int8 GEMM")


def _tensor(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _weight(n: int, k: int, seed: int) -> torch.Tensor:
    """Channels of very different magnitudes (0.01 to 1), as a model's are: one scale for all would show."""
    return _tensor(n, k, seed=seed) * torch.logspace(-2, 0, n)[:, None]


def _rows(t: int, k: int, seed: int) -> torch.Tensor:
    """Rows of different magnitudes, each with an outlier, as a layer's activations have."""
    x = _tensor(t, k, seed=seed) * torch.logspace(-1, 1, t)[:, None]
    x[:, 7] *= 20
    return x


def test_quantization_maps_each_channel_and_row_onto_its_own_scale():
    w, x = _weight(96, 64, seed=1), _rows(5, 64, seed=2)
    qw, sw = quantize_weight(w)
    assert qw.dtype == torch.int8 and sw.shape == (96,)
    assert torch.equal(qw.abs().amax(dim=1), torch.full((96,), QMAX, dtype=torch.int8))  # each channel's full range
    torch.testing.assert_close(qw.float() * sw[:, None], w, rtol=0, atol=float(sw.max()) / 2)
    assert ((qw.float() * sw[:, None] - w).abs() <= sw[:, None] / 2 + 1e-7).all()  # rounding: half a step at most
    qx, sx = quantize_rows_torch(x)
    assert qx.dtype == torch.uint8 and sx.shape == (5, 1)
    values = qx.int() - 128
    assert torch.equal(values.abs().amax(dim=1), torch.full((5,), QMAX, dtype=torch.int32))
    assert ((values.float() * sx - x).abs() <= sx / 2 + 1e-6).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpp_row_quantization_agrees_with_torchs(dtype):
    """One pass in C++ (where built) against the torch ops it replaces: the same scales, the same bytes but for a
    value that lands within an ulp of a half (bf16 rows do, often), which may round either way."""
    x = _rows(300, 576, seed=14).to(dtype)
    x[3] = 0
    q, s = quantize_rows(x)
    ref_q, ref_s = quantize_rows_torch(x)
    assert torch.equal(s, ref_s)
    differ = q != ref_q
    assert (q.int() - ref_q.int()).abs().max() <= 1 and int(differ.sum()) <= 1e-3 * q.numel()
    halves = (x.float() / s).abs().frac()[differ]
    assert ((halves - 0.5).abs() < 1e-3).all()
    assert torch.equal(q[3], torch.full((576,), 128, dtype=torch.uint8))


@pytest.mark.parametrize("rows", [1, 3, 17, 300, 2048])
@pytest.mark.parametrize("shape", [(960, 576), (576, 1536)])
def test_the_output_is_the_product_of_the_quantized_operands(rows, shape):
    """oneDNN's int8 GEMM, its zero point and both scales: the fp64 product of the dequantized operands, to fp32's
    rounding."""
    w, b, x = _weight(*shape, seed=3), _tensor(shape[0], seed=4), _rows(rows, shape[1], seed=5)
    lin = Int8Linear(w, b)
    out = lin(x)
    qw, sw = quantize_weight(w, lin.qmax)
    qx, sx = quantize_rows(x)
    ref = ((qx.double() - 128) * sx.double()) @ (qw.double() * sw.double()[:, None]).T + b.double()
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


@pytest.mark.parametrize("shape", [(960, 576), (576, 576), (576, 1536)])
def test_the_error_against_the_float_matmul_is_within_the_quantization_bound(shape):
    """x = x^ + dx, w = w^ + dw with |dx| <= s_x / 2 and |dw| <= s_w / 2 elementwise, so
    |x w - x^ w^| <= s_w / 2 * sum|x| + s_x / 2 * sum|w| + K s_x s_w / 4 for each output. A scale on the wrong axis
    (per input channel, or one per tensor) breaks it."""
    n, k = shape
    w, x = _weight(n, k, seed=6), _rows(64, k, seed=7)
    lin = Int8Linear(w)
    err = (lin(x) - F.linear(x, w)).abs()
    sw = w.abs().amax(dim=1) / lin.qmax
    sx = x.abs().amax(dim=1, keepdim=True) / QMAX
    bound = sw / 2 * x.abs().sum(1, keepdim=True) + sx / 2 * w.abs().sum(1) + k * sx * sw / 4
    assert (err <= bound * 1.001 + 1e-5).all(), float((err / bound).max())
    assert float(err.mean()) < 0.05 * float(bound.mean())  # rounding errors cancel: far inside the worst case


def test_weights_take_7_bits_where_the_cpu_lacks_vnni(monkeypatch):
    """Without VNNI oneDNN's int16 pair sums of u8 x s8 would saturate on 8-bit weights."""
    monkeypatch.setattr(int8_linear, "has_vnni", lambda: False)
    lin = Int8Linear(_weight(64, 32, seed=13))
    assert lin.qmax == QMAX_WITHOUT_VNNI == 63 and lin.backend == "onednn-int8-w7"
    monkeypatch.setattr(int8_linear, "has_vnni", lambda: True)
    assert Int8Linear(_weight(64, 32, seed=13)).backend == "onednn-int8"


def test_a_row_gives_the_same_bits_alone_and_in_any_batch():
    """int32 sums are exact: no batch-size-dependent rounding (the float Linear needs its two-row trick)."""
    lin, x = Int8Linear(_weight(960, 576, seed=8)), _rows(300, 576, seed=9)
    batch = lin(x)
    for r in (0, 17, 299):
        assert torch.equal(lin(x[r : r + 1]), batch[r : r + 1])
        assert torch.equal(lin(x[r : r + 3])[0], batch[r])


def test_shapes_dtypes_and_edge_rows():
    w, b = _weight(64, 32, seed=10), _tensor(64, seed=11)
    lin = Int8Linear(w, b)
    assert lin.shape == (64, 32) and lin.backend.startswith("onednn-int8")
    assert lin.nbytes == 64 * 32 + 64 * 4 + 64 * 4  # int8 W, its scales, the bias
    x = _rows(6, 32, seed=12)
    assert torch.equal(lin(x.view(2, 3, 32)), lin(x).view(2, 3, 64))  # leading dims kept
    assert lin(x[:0]).shape == (0, 64)
    zero = lin(torch.zeros(2, 32))
    assert torch.equal(zero, b.expand(2, 64))  # an all-zero row: exactly the bias, no NaN from a zero scale
    bf16 = Int8Linear(w.bfloat16(), b.bfloat16())(x.bfloat16())
    assert bf16.dtype == torch.bfloat16
    ref = F.linear(x, w, b)
    torch.testing.assert_close(bf16.float(), ref, rtol=0.02, atol=0.02 * float(ref.abs().max()))
