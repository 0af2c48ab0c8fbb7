"""A model's matmul in int8 (W8A8, `engine.weights: w8a8`): W quantized once at load to int8 with one scale per
output channel, each step's activation rows to int8 with one scale per row (per token, symmetric, dynamic), their
products summed exactly in int32 by oneDNN's int8 GEMM on W packed once, then scaled back:
y[t, n] = acc[t, n] * s_x[t] * s_w[n] + b[n].

Without VNNI (an AVX2 or older AVX-512 CPU) oneDNN multiplies in vpmaddubsw, which adds each pair of u8 x s8 products
in int16 and saturates past 2 x 255 x 63: there W takes 7 bits (-63..63), as oneDNN's guide to int8 advises, so that
the sums stay exact; the activations keep 8.

The int32 sums are exact whatever order a kernel takes, so a row's result does not depend on its batch or on how
many rows a kernel runs at once (no two-row trick as model/matmul/linear.py needs). oneDNN's x86 int8 kernels multiply
unsigned by signed bytes (vpmaddubsw, VNNI's vpdpbusd): a row's int8 values go in shifted by 128 with 128 as its zero
point, which oneDNN takes back exactly."""

from __future__ import annotations

import torch

from batchjob.model.cpu_features import has_vnni
from batchjob.model.cpu_native import native_ops_for

QMAX = 127  # symmetric int8: -127..127, so that negating a value never overflows
QMAX_WITHOUT_VNNI = 63  # 7-bit weights: vpmaddubsw's int16 pair sums stay below 32,767
_ZERO_POINT = 128  # the shift that makes a row's int8 values the unsigned bytes oneDNN's x86 kernels read
_TINY = 1e-12  # the scale of an all-zero row or channel: its values quantize to 0 whatever the scale


def weight_qmax() -> int:
    """The largest weight magnitude this CPU's int8 GEMM sums exactly: QMAX with VNNI, else QMAX_WITHOUT_VNNI."""
    return QMAX if has_vnni() else QMAX_WITHOUT_VNNI


def quantize_weight(weight: torch.Tensor, qmax: int = QMAX) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] -> (int8 [N, K], fp32 scale [N]): each output channel's largest magnitude maps to qmax."""
    w = weight.float()
    scale = w.abs().amax(dim=1).clamp(min=_TINY) / qmax
    return torch.round(w / scale[:, None]).clamp_(-qmax, qmax).to(torch.int8), scale


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (uint8 [T, K] holding int8 + 128, fp32 scale [T, 1]): each row's largest magnitude maps to QMAX.
    The C++ kernel's result where it is built (one pass), else torch's: the same but for a value within an ulp of a
    half, which may round either way."""
    native = native_ops_for(x.device, x.dtype)
    if native is not None and x.dim() == 2 and x.stride(-1) == 1:
        return native.quantize_rows(x)
    return quantize_rows_torch(x)


def quantize_rows_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows in torch's ops: x * (QMAX / max|x|), rounded half to even, shifted by 128."""
    amax = x.float().abs().amax(dim=1, keepdim=True).clamp_(min=_TINY)
    q = torch.round(x.float() * (QMAX / amax)).clamp_(-QMAX, QMAX).add_(_ZERO_POINT)
    return q.to(torch.uint8), amax * (1 / QMAX)


class Int8Linear:
    """Linear's interface (matmul/linear.py) over int8 W [out_features, in_features] and an optional bias; its output
    in W's dtype as given."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, qmax: int | None = None):
        """`qmax`: the weights' range, by default weight_qmax()."""
        self.qmax = weight_qmax() if qmax is None else qmax
        q, self.weight_scale = quantize_weight(weight, self.qmax)
        self.packed = torch.ops.onednn.qlinear_prepack(q, None)
        self.bias = None if bias is None else bias.float()
        self.out_dtype, self._shape = weight.dtype, weight.shape
        self._zero_points = torch.zeros(weight.shape[0], dtype=torch.int64)  # W is symmetric

    @property
    def backend(self) -> str:
        """Whose GEMM computes it, and on how many bits of W, as the numerics name it."""
        return "onednn-int8" if self.qmax == QMAX else f"onednn-int8-w{self.qmax.bit_length() + 1}"

    @property
    def shape(self) -> torch.Size:
        return self._shape

    @property
    def nbytes(self) -> int:
        """What one matmul reads of W, its scales and the bias."""
        bias = 0 if self.bias is None else self.bias.numel() * 4
        return self._shape.numel() + self.weight_scale.numel() * 4 + bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n, k = self._shape
        rows = x.reshape(-1, k)
        if not rows.numel():
            return x.new_empty(x.shape[:-1] + (n,), dtype=self.out_dtype)
        q, row_scale = quantize_rows(rows)
        y = torch.ops.onednn.qlinear_pointwise(
            q, 1.0, _ZERO_POINT, self.packed, self.weight_scale, self._zero_points, None, 1.0, 0, torch.float32,
            "none", [], "",
        )  # fmt: skip
        y.mul_(row_scale)  # the weights' scales oneDNN applied; the rows' are per row, which it takes per tensor only
        if self.bias is not None:
            y.add_(self.bias)
        return y.to(self.out_dtype).view(x.shape[:-1] + (n,))
