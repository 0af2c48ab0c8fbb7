"""LoRA updates of a step's rows on a GPU (punica's SGMV): the rows come as runs of one adapter (LoraBatch.segments),
and one kernel, launched twice, multiplies each run by its adapter's slot of the stacked weights: the shrink x @ a[slot]
into [T, rank], then the expand of that @ b[slot] added onto the base matmul's output. Rows of no adapter are in no run
and are not touched. A program takes one run's block of rows and one block of output columns, so every output element
has one writer and the expand adds in place without atomics."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchjob.kernels.common import check_device, dot, dot_dtype, next_pow2


@triton.jit
def _sgmv_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    seg_ptr,
    K,
    N,
    stride_x,
    stride_ws,
    stride_wk,
    stride_out,
    ACCUMULATE: tl.constexpr,
    IEEE: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    seg = tl.program_id(0)
    start = tl.load(seg_ptr + seg * 3).to(tl.int64)
    length = tl.load(seg_ptr + seg * 3 + 1)
    slot = tl.load(seg_ptr + seg * 3 + 2).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < length  # a run shorter than the grid's longest leaves the rest of its blocks masked
    col_ok = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        xt = tl.load(
            x_ptr + (start + rows)[:, None] * stride_x + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0
        )
        wt = tl.load(
            w_ptr + slot * stride_ws + ks[:, None] * stride_wk + cols[None, :],
            mask=k_ok[:, None] & col_ok[None, :],
            other=0.0,
        )
        acc += dot(xt.to(DOT_DTYPE), wt.to(DOT_DTYPE), IEEE)
    ptrs = out_ptr + (start + rows)[:, None] * stride_out + cols[None, :]
    ok = row_ok[:, None] & col_ok[None, :]
    if ACCUMULATE:
        acc += tl.load(ptrs, mask=ok, other=0.0).to(tl.float32)
    tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=ok)


def _sgmv(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, segments: torch.Tensor, longest: int, add: bool) -> None:
    """out[run rows] (+)= x[run rows] @ w[run slot] for each run; w is [slots, K, N] with unit stride along N."""
    k, n = w.shape[1], w.shape[2]
    block_m = 16 if longest <= 16 else 32  # decode runs are short: smaller row blocks waste less
    block_n = min(64, max(16, next_pow2(n)))
    block_k = min(64, max(16, next_pow2(k)))
    grid = (segments.shape[0], triton.cdiv(longest, block_m), triton.cdiv(n, block_n))
    _sgmv_kernel[grid](
        x, w, out, segments, k, n, x.stride(0), w.stride(0), w.stride(1), out.stride(0),
        ACCUMULATE=add, IEEE=x.dtype == torch.float32, DOT_DTYPE=dot_dtype(x.dtype),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )  # fmt: skip


def lora_add(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, batch) -> None:
    """As batchjob.model.ops.lora_add: the shrink into a [T, rank] buffer in x's dtype (as the torch form rounds
    it), then the expand added onto y."""
    check_device(x, y, a, b)
    if batch.longest_segment == 0:
        return
    x = x if x.stride(-1) == 1 else x.contiguous()
    shrunk = torch.empty(x.shape[0], a.shape[2], dtype=x.dtype, device=x.device)
    _sgmv(x, a, shrunk, batch.segments, batch.longest_segment, add=False)
    _sgmv(shrunk, b, y, batch.segments, batch.longest_segment, add=True)
