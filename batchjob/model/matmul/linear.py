"""A model's matmul, y = x W^T + b, with W packed once for oneDNN's GEMM.

torch's F.linear on a CPU hands W to MKL's sgemm, which copies it into its blocked layout on every call: at decode
sizes (tens of rows against a 576 x 3,072 weight) that copy costs as much as the arithmetic. Packed once at load into
oneDNN's blocked layout (`mkldnn._reorder_linear_weight` / `mkldnn._linear_pointwise`, the ops inductor uses when it
freezes a CPU model; vLLM's CPU backend runs its linear layers through oneDNN too), the matmuls beat F.linear at
every row count measured, most at decode's few rows, where MKL's own packed GEMM did not (`python
scripts/cpu_ops_ab.py gemm`; docs/perf-history.md). Every row count takes the packed path, one code path whatever a
step holds; W itself is let go unless the caller keeps it (a tied embedding): the packed copy is all a matmul reads.
Float32, and bfloat16 where oneDNN computes it (bf16 products summed in fp32, rounded to bf16 once at the end), on a
CPU; elsewhere (a GPU, other dtypes) F.linear."""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from batchjob.model.cpu_features import cpu_flags

log = logging.getLogger(__name__)

_PACK_HINT_ROWS = 64  # oneDNN packs for a row count; the layout serves any (checked at load, and in the tests)
# How close the packed GEMM must come to F.linear on a probe at load: fp32 sums in another order; bf16 rounds each
# output once, and F.linear (MKL) may round otherwise.
_PROBE_TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
# oneDNN's AMX bf16 GEMM picks its blocking of K from the row count, and so sums a row in another order at 36 rows
# than at 37, at 255 than at 256 (as measured on a Xeon with AMX, per weight shape): no row count is safe to call it
# with unless checked. There, rows are computed in blocks of exactly _AMX_ROW_BLOCK (the last padded), within which a
# row's sums do not depend on its place or its neighbours, or in blocks of a multiple of it that a probe at load
# shows to sum each row as the 64-row block does (fewer calls: 64-row calls alone ran 512 rows at half the rate).
_AMX_ROW_BLOCK = 64
_AMX_WIDER_BLOCKS = (512, 256, 128)
_PROBE_DRAWS = 3


def _packable(weight: torch.Tensor) -> bool:
    if weight.device.type != "cpu" or weight.dim() != 2 or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return weight.dtype == torch.float32


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class Linear:
    """W [out_features, in_features] and an optional bias; callable on x [..., in_features]."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, keep_weight: bool = False, pack: bool = True
    ):
        """Without `pack`, W is used as it is (a view into weights another layout owns)."""
        self.weight, self.bias = weight, bias
        self.packed: torch.Tensor | None = None
        # Rows per GEMM call, widest first, where the call's row count changes its sums (else empty).
        self.row_blocks: tuple[int, ...] = ()
        if pack and _packable(weight):
            probe = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.dtype)
            tol = _PROBE_TOL[weight.dtype]
            try:
                packed = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_HINT_ROWS)
                ours, ref = _packed_linear(probe, packed, None).float(), F.linear(probe, weight).float()
                agrees = torch.allclose(ours, ref, tol, tol)
            except RuntimeError as e:  # a oneDNN build without this primitive (another CPU's backend, say)
                log.warning("oneDNN cannot pack a %s weight (%s); not packing", tuple(weight.shape), e)
            else:
                if agrees:
                    self.packed = packed
                    if weight.dtype == torch.bfloat16 and "amx_bf16" in cpu_flags().split():
                        self.row_blocks = _row_blocks_summing_as_one(*weight.shape)
                    if not keep_weight:  # only W's shape is read again: a zero-stride stand-in holds it
                        self.weight = weight.new_zeros(1).expand(weight.shape)
                else:  # a oneDNN build that packs otherwise than it computes: stay with F.linear
                    log.warning("packed GEMM disagrees with F.linear for a %s weight; not packing", tuple(weight.shape))

    @property
    def backend(self) -> str:
        """Whose GEMM computes it: its sums run in that library's order."""
        return "torch" if self.packed is None else "onednn"

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    @property
    def nbytes(self) -> int:
        """What one matmul reads of W and the bias."""
        bias = 0 if self.bias is None else self.bias.numel() * self.bias.element_size()
        return self.weight.numel() * self.weight.element_size() + bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.weight.dtype)  # a bf16 model's hidden states into a float32 LM head
        if self.packed is None or not x.numel():
            return F.linear(x, self.weight, self.bias)
        if self.row_blocks:
            return self._in_row_blocks(x)
        if x.numel() == x.shape[-1]:
            # oneDNN's one-row kernel sums in another order than its kernels for more rows, which agree with each
            # other: a row computed alone would differ in its last bits from the same row in a batch (in bf16, a
            # whole rounding step now and then, enough to flip a greedy token). Two copies of the row take the
            # batch kernels; at one row the matmul's time is reading W, not the arithmetic.
            return _packed_linear(x.reshape(1, -1).expand(2, -1), self.packed, self.bias)[:1].view(x.shape[:-1] + (-1,))
        return _packed_linear(x, self.packed, self.bias)

    def _in_row_blocks(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        n, unit = rows.shape[0], self.row_blocks[-1]
        if n % unit:  # a last, partial block is padded; the others are views
            rows = torch.cat([rows, rows.new_zeros(unit - n % unit, rows.shape[1])])
        outs, start = [], 0
        while start < rows.shape[0]:
            size = next(b for b in self.row_blocks if b <= rows.shape[0] - start)
            outs.append(_packed_linear(rows[start : start + size], self.packed, self.bias))
            start += size
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return out[:n].view(x.shape[:-1] + (-1,))


@functools.cache
def _row_blocks_summing_as_one(out_features: int, in_features: int) -> tuple[int, ...]:
    """_AMX_ROW_BLOCK and those of _AMX_WIDER_BLOCKS whose calls give each row bit for bit what 64-row calls give, on
    probes with a spread of magnitudes (some inputs x1000, as the down projection's are), where another order of
    sums shows. oneDNN picks its kernel by shape, not by values: one probe per shape, on a weight of its own, serves
    every layer of that shape."""
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(out_features, in_features, generator=gen) * 0.05).to(torch.bfloat16)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_HINT_ROWS)
    agree = []
    for size in _AMX_WIDER_BLOCKS:
        for draw in range(_PROBE_DRAWS):
            x = torch.randn(size, in_features, generator=gen)
            x[:, draw::7] *= 1000
            x = x.to(torch.bfloat16)
            unit = torch.cat([_packed_linear(b, packed, None) for b in x.split(_AMX_ROW_BLOCK)])
            if not torch.equal(_packed_linear(x, packed, None), unit):
                break
        else:
            agree.append(size)
    return (*agree, _AMX_ROW_BLOCK)
