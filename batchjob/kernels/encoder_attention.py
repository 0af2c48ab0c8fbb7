"""Bidirectional attention over packed variable-length sequences, as an encoder (BERT) runs it: q, k, v [T, H, D]
hold the sequences' rows end to end (no padding, no KV cache) and cu_seqlens [S + 1] the row where each sequence
starts, and the end; every query attends to all the keys of its own sequence and to no other (flash-attn's
flash_attn_varlen_func without causal).

A program owns BLOCK_M query rows of one sequence and one head. It finds its sequence by a binary search of
cu_seqlens (common.find_seq), so the launch needs no host-side plan and reads no device value. Keys are read
BLOCK_N at a time with an online softmax in fp32 (exp2 domain); a head dim that is not a power of two is padded to
one with masked lanes. Tile shapes depend only on the head dim, so a row's result does not depend on what else is
in the batch."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchjob.kernels.common import LOG2E, check_device, dot, dot_dtype, find_seq, next_pow2

MAX_HEAD_DIM = 256
BLOCK_M = 64


@triton.jit
def _varlen_kernel(
    out_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    cu_seqlens_ptr,
    scale_log2,
    num_seqs,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid = tl.program_id(0)
    head = tl.program_id(1)
    seq = find_seq(cu_seqlens_ptr, pid, num_seqs, BLOCK_M)
    start = tl.load(cu_seqlens_ptr + seq)
    seq_len = tl.load(cu_seqlens_ptr + seq + 1) - start
    q_block = pid - (start // BLOCK_M + seq)
    if q_block * BLOCK_M >= seq_len:
        return

    offs_m = q_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    m_ok = offs_m < seq_len
    d_ok = offs_d < HEAD_DIM
    rows = (start + offs_m).to(tl.int64)
    q = tl.load(
        q_ptr + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
        mask=m_ok[:, None] & d_ok[None, :],
        other=0.0,
    ).to(DOT_DTYPE)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    for n_start in range(0, seq_len, BLOCK_N):
        offs_n = n_start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < seq_len
        keys = (start + offs_n).to(tl.int64)
        k = tl.load(
            k_ptr + keys[None, :] * stride_kt + head * stride_kh + offs_d[:, None],
            mask=n_ok[None, :] & d_ok[:, None],
            other=0.0,
        )
        v = tl.load(
            v_ptr + keys[:, None] * stride_vt + head * stride_vh + offs_d[None, :],
            mask=n_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        s = dot(q, k.to(DOT_DTYPE), IEEE) * scale_log2  # [BLOCK_M, BLOCK_N], fp32
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: every tile holds at least one key of the sequence
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), IEEE)
        m_i = m_new
    o = acc / l_i[:, None]
    tl.store(
        out_ptr + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=m_ok[:, None] & d_ok[None, :],
    )


def varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float
) -> torch.Tensor:
    """Each query row of q [T, H, D] attends to every key of its own sequence in k, v [T, H, D]; sequence i is rows
    cu_seqlens[i]:cu_seqlens[i + 1] (an int32 tensor on q's device). q, k and v may be strided views (of one fused
    qkv, say) with unit stride along D. Returns [T, H, D] in q's dtype."""
    check_device(q, k, v, cu_seqlens)
    T, H, D = q.shape
    assert k.shape == q.shape and v.shape == q.shape, f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
    assert D <= MAX_HEAD_DIM, f"head dim {D} > {MAX_HEAD_DIM}"
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    num_seqs = cu_seqlens.numel() - 1
    if T == 0 or num_seqs <= 0:
        return out
    d_pad = max(16, next_pow2(D))  # tl.dot's least K on a GPU
    _varlen_kernel[(T // BLOCK_M + num_seqs, H)](
        out,
        q,
        k,
        v,
        cu_seqlens,
        float(scale) * LOG2E,
        num_seqs,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        out.stride(0),
        out.stride(1),
        HEAD_DIM=D,
        D_PAD=d_pad,
        BLOCK_M=BLOCK_M,
        # the [BLOCK_M, D_PAD] accumulator and a K and a V tile held at once: narrower key tiles past D 64, and
        # past D 128 two pipeline stages, not three (an fp32 K and V tile of 256 x 32 are 64 KiB of shared memory)
        BLOCK_N=64 if d_pad <= 64 else 32,
        DOT_DTYPE=dot_dtype(q.dtype),
        IEEE=q.dtype == torch.float32,
        num_warps=4,
        num_stages=3 if d_pad <= 128 else 2,
    )
    return out
