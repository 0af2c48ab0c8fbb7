"""A model's matmul, y = x W^T + b, with W packed once for the CPU's GEMM.

torch's F.linear on a CPU hands W to MKL's sgemm, which copies it into its blocked layout on every call: at decode
sizes (tens of rows against a 576 x 3,072 weight) that copy costs as much as the arithmetic. Packed once at load
(cblas_sgemm_pack, through torch's own `mkl::_mkl_reorder_linear_weight` / `_mkl_linear`, the ops inductor uses when it
freezes a CPU model), a decode step's matmuls ran ~1.6-1.9x faster at 8-64 rows, ~1.15x at 128-256, the same at 2,048
(`python scripts/cpu_ops_ab.py gemm`). Every row count takes the packed path, one code path whatever a step holds;
W itself is let go unless the caller keeps it (a tied embedding): the packed copy is all a matmul reads. Float32 on
a CPU with MKL only; elsewhere (a GPU, other dtypes) F.linear."""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

_PACK_HINT_ROWS = 64  # MKL packs for a row count; the layout read back is the same for any (checked at load)


def _packable(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and weight.dim() == 2
        and torch.backends.mkl.is_available()
        and hasattr(torch.ops.mkl, "_mkl_linear")
    )


class Linear:
    """W [out_features, in_features] and an optional bias; callable on x [..., in_features]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, keep_weight: bool = False):
        self.weight, self.bias = weight, bias
        self.packed: torch.Tensor | None = None
        if _packable(weight):
            packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, _PACK_HINT_ROWS)
            probe = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(0))
            got = torch.ops.mkl._mkl_linear(probe, packed, weight, None, probe.shape[0])
            if torch.allclose(got, F.linear(probe, weight), rtol=1e-4, atol=1e-4):
                self.packed = packed
                if not keep_weight:  # _mkl_linear reads only W's shape and dtype: a zero-stride stand-in holds them
                    self.weight = weight.new_zeros(1).expand(weight.shape)
            else:  # a BLAS whose packed layout depends on the row count: stay with F.linear
                log.warning("packed GEMM disagrees with F.linear for a %s weight; not packing", tuple(weight.shape))

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    @property
    def nbytes(self) -> int:
        """What one matmul reads of W and the bias."""
        bias = 0 if self.bias is None else self.bias.numel() * self.bias.element_size()
        return self.weight.numel() * self.weight.element_size() + bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None or not x.numel():
            return F.linear(x, self.weight, self.bias)
        rows = x.numel() // x.shape[-1]
        # With prepack_batch_size equal to the rows, _mkl_linear always takes cblas_sgemm_compute on the packed W.
        return torch.ops.mkl._mkl_linear(x, self.packed, self.weight, self.bias, rows)
