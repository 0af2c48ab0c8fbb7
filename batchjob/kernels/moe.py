"""Fused mixture-of-experts: one grouped GEMM over every expert for gate_up, the activation, one for down with the
routing weight multiplied in, then each token's k terms summed (vLLM's fused_moe, in our own code).

The step's (token, expert) pairs are sorted by expert and each expert's run padded to BLOCK_M rows on the device
(moe_align_block_size), into a buffer sized for the worst case: the launch grid depends only on host values (the
token count, k, the experts), programs past the real blocks exit at once, and nothing is read back on the host, so
that a CUDA graph can capture a MoE step. A program multiplies BLOCK_M pair rows of one expert, their activations
gathered by token, by a BLOCK_N x K tile of that expert's weight; fp32 accumulation. No atomics: each output element
is written by one program, and the k terms of a token are summed in a fixed order, so results are deterministic and
do not depend on what else is in the batch."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchjob.kernels.common import check_device, next_pow2
from batchjob.kernels.elementwise import silu_and_mul
from batchjob.model.moe import StackedExperts


def moe_align_block_size(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids [T, k] -> (sorted_ids, expert_ids, num_tokens_post_padded), all on the device:
    sorted_ids [blocks * block_m] int32: pair ids p = t * k + j sorted by expert (in pair order within one), each
    expert's run padded to a multiple of block_m with T * k (no pair), then padding to the buffer's fixed size, the
    worst case T * k + min(E, T * k) * (block_m - 1) rounded up to whole blocks;
    expert_ids [blocks] int32: the expert of each block; num_tokens_post_padded [1] int32: the rows in real blocks.
    The counts are one-hot sums, not torch.bincount (which reads the largest id on the host on a GPU)."""
    flat = topk_ids.flatten()
    pairs = flat.numel()
    device = flat.device
    one_hot = (flat.unsqueeze(1) == torch.arange(num_experts, device=device)).to(torch.int32)  # [P, E]
    seen = one_hot.cumsum(0, dtype=torch.int32)  # seen[p, e]: pairs up to p routed to e
    counts = seen[-1]
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0, dtype=torch.int32)
    rank = seen.gather(1, flat.unsqueeze(1)).squeeze(1) - 1  # the pair's place in its expert's run
    dest = (ends - padded)[flat] + rank
    num_blocks = triton.cdiv(pairs + min(num_experts, pairs) * (block_m - 1), block_m)
    sorted_ids = torch.full((num_blocks * block_m,), pairs, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, dest.long(), torch.arange(pairs, dtype=torch.int32, device=device))
    block_starts = torch.arange(0, num_blocks * block_m, block_m, dtype=torch.int32, device=device)
    # a block's expert: the first whose padded run ends past the block's start (blocks past the last run: clamped,
    # never read, their programs exit)
    expert_ids = torch.searchsorted(ends, block_starts, right=True).clamp_(max=num_experts - 1).to(torch.int32)
    return sorted_ids, expert_ids, ends[-1:].to(torch.int32)


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    topk_weights_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    num_post_padded_ptr,
    N,
    K,
    num_pairs,
    stride_am,
    stride_ak,
    stride_be,
    stride_bn,
    stride_bk,
    stride_cm,
    stride_cn,
    PAIRS_PER_A_ROW: tl.constexpr,  # k where A holds one row a token (gate_up), 1 where one a pair (down)
    MUL_ROUTED_WEIGHT: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """C[p, :] = A[p // PAIRS_PER_A_ROW, :] @ B[expert(p)].T (times the pair's routing weight) for the pair rows of
    one block of sorted_ids and BLOCK_N columns."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // num_n
    pid_n = pid % num_n
    if pid_m * BLOCK_M >= tl.load(num_post_padded_ptr):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + offs_m)
    real = pair < num_pairs
    a_row = (pair // PAIRS_PER_A_ROW).to(tl.int64)
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_row[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + expert * stride_be + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None] * stride_bk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        a = tl.load(a_ptrs, mask=real[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc += tl.dot(a, b, input_precision=PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if MUL_ROUTED_WEIGHT:
        acc = acc * tl.load(topk_weights_ptr + pair, mask=real, other=0.0).to(tl.float32)[:, None]
    c_ptrs = c_ptr + pair[:, None].to(tl.int64) * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=real[:, None] & n_ok[None, :])


@triton.jit
def _moe_sum_kernel(x_ptr, out_ptr, n, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    """out[t] = x[t, 0] + ... + x[t, k-1] in this order, in fp32: x [T, k, n] contiguous."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(x_ptr + (t * TOP_K + j) * n + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * n + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


def _block_m(pairs: int, num_experts: int) -> int:
    """Rows of one expert a program takes: about the pairs an expert gets on average (16 to 64), so that decode's
    few rows an expert do not pad to 64 and prefill's many fill the tensor cores."""
    return min(64, max(16, next_pow2(pairs // max(num_experts, 1))))


def _grouped_gemm(
    a, w, c, topk_weights, sorted_ids, expert_ids, num_post_padded, pairs_per_a_row: int, mul_routed_weight: bool,
    block_m: int,
) -> None:  # fmt: skip
    n, k = w.shape[1], w.shape[2]
    block_n = 64
    block_k = 32 if a.dtype == torch.float32 else 64
    grid = (expert_ids.numel() * triton.cdiv(n, block_n),)
    _grouped_gemm_kernel[grid](
        a, w, c, topk_weights, sorted_ids, expert_ids, num_post_padded,
        n, k, c.shape[0],
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2), c.stride(0), c.stride(1),
        PAIRS_PER_A_ROW=pairs_per_a_row,
        MUL_ROUTED_WEIGHT=mul_routed_weight,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",  # fp32 exactly; tf32 is ignored for 16-bit inputs
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=4,
    )  # fmt: skip


def fused_moe(
    x: torch.Tensor, experts: StackedExperts, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """x [T, H]; each row's k experts topk_ids [T, k] and their weights [T, k] -> [T, H]: the sum over the row's
    experts of weight * down(silu(gate) * up)."""
    check_device(x, experts.w13, experts.w2, topk_weights, topk_ids)
    t, hidden = x.shape
    top_k = topk_ids.shape[1]
    num_experts = experts.w13.shape[0]
    out = torch.empty(t, hidden, dtype=x.dtype, device=x.device)
    if not t:
        return out
    pairs = t * top_k
    block_m = _block_m(pairs, num_experts)
    sorted_ids, expert_ids, num_post_padded = moe_align_block_size(topk_ids, num_experts, block_m)
    x = x if x.stride(-1) == 1 else x.contiguous()
    weights = topk_weights.reshape(-1)
    plan = (weights, sorted_ids, expert_ids, num_post_padded)
    gate_up = torch.empty(pairs, experts.w13.shape[1], dtype=x.dtype, device=x.device)
    _grouped_gemm(x, experts.w13, gate_up, *plan, pairs_per_a_row=top_k, mul_routed_weight=False, block_m=block_m)
    act = silu_and_mul(gate_up)
    terms = torch.empty(pairs, hidden, dtype=x.dtype, device=x.device)
    _grouped_gemm(act, experts.w2, terms, *plan, pairs_per_a_row=1, mul_routed_weight=True, block_m=block_m)
    block = min(1024, next_pow2(hidden))
    _moe_sum_kernel[(t, triton.cdiv(hidden, block))](terms, out, hidden, TOP_K=top_k, BLOCK=block, num_warps=4)
    return out
