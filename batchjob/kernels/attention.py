"""Paged attention over a mixed step: varlen prefill chunks (cached prefix + own causal part) and decodes.

Two kernels plus a reduction:

* `_varlen_kernel` serves any query rows (prefill chunks, and decodes too when the split path is off). A program
  owns one KV head and a tile of BLOCK_M rows = BLOCK_Q query tokens of one sequence x the GROUP query heads that
  share the KV head (GQA: row m is token m // GROUP, head kvh * GROUP + m % GROUP; BLOCK_M is a power of two, spare
  rows are masked). Programs find their sequence by a binary search of query_start_loc, so the launch needs no
  host-side plan. Keys are read through the block table one BLOCK_N tile at a time (any page size), with an
  online softmax in fp32 (exp2 domain).
* `_decode_kernel` serves the one-row sequences (decodes), split along the context into fixed SPLIT_SIZE chunks
  (grid: sequence x KV head x split). A sequence whose context fits one split writes its output directly; longer
  ones write partial (max, sum, unnormalized acc) per split, which `_combine_kernel` merges in split order.

Batch invariance: tile shapes depend only on (heads, head dim, dtype), a row's path depends only on its own query
length, and its splits and their merge order only on its own context length, so a row's result does not depend on
what else is in the batch.

FP8 caches (float8_e4m3fn, passed as uint8 views) are dequantized in the kernel: the per-(slot, head) K scale
multiplies the score columns after Q.K^T, the V scale multiplies P's columns before P.V.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchjob.kernels.common import LOG2E, check_device, dot, dot_dtype, find_seq, next_pow2, tanh
from batchjob.model.attention_metadata import AttentionMetadata
from batchjob.model.fp8 import FP8_DTYPE

LOG2E_C: tl.constexpr = tl.constexpr(LOG2E)  # the same, inside the kernels
SPLIT_SIZE = 512  # keys per split of the decode kernel: fixed, so that a row's result is batch-independent
DECODE_BLOCK_N = 64
VARLEN_BLOCK_M = 64
VARLEN_BLOCK_N = 64
# Bytes of the varlen kernel's Q, K, V and accumulator tiles that stay in registers at 4 warps: 64 x 64 tiles in bf16
# at head dim 128. Twice that (fp32 at head dim 128) spilled: fp32 prefill ran 16x slower than torch's.
VARLEN_TILE_BYTES = 2 * (VARLEN_BLOCK_M + VARLEN_BLOCK_N) * 128 * 2


@triton.jit
def _attend_tile(
    acc,
    m_i,
    l_i,
    q,
    kc_ptr,
    vc_ptr,
    ks_ptr,
    vs_ptr,
    bt_row_ptr,
    kvh,
    start,
    kv_end,
    qpos,
    scale_log2,
    window,
    softcap,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_sb,
    stride_ss,
    PAGE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    FP8: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    IEEE: tl.constexpr,
    WINDOWED: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """One online-softmax step over keys start .. start + BLOCK_N (those < kv_end and, if CAUSAL, <= qpos; if
    WINDOWED, > qpos - window). With SOFTCAP the scaled scores s become softcap * tanh(s / softcap)."""
    offs_n = start + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D_PAD)
    n_ok = offs_n < kv_end
    d_ok = offs_d < HEAD_DIM
    blk = tl.load(bt_row_ptr + offs_n // PAGE, mask=n_ok, other=0).to(tl.int64)
    page_off = offs_n % PAGE
    kv_off = blk * stride_cb + page_off * stride_cs + kvh * stride_ch
    k = tl.load(kc_ptr + kv_off[None, :] + offs_d[:, None], mask=n_ok[None, :] & d_ok[:, None], other=0.0)
    v = tl.load(vc_ptr + kv_off[:, None] + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
    if FP8:
        k = k.to(tl.float8e4nv, bitcast=True)
        v = v.to(tl.float8e4nv, bitcast=True)
        sc_off = blk * stride_sb + page_off * stride_ss + kvh
        k_scale = tl.load(ks_ptr + sc_off, mask=n_ok, other=0.0)
        v_scale = tl.load(vs_ptr + sc_off, mask=n_ok, other=0.0)
    s = dot(q, k.to(DOT_DTYPE), IEEE)  # [BLOCK_M, BLOCK_N], fp32
    if FP8:
        s = s * k_scale[None, :]
    if SOFTCAP:
        s = softcap * tanh(s * scale_log2 / softcap) * LOG2E_C  # scale_log2 is the plain scale here
    else:
        s = s * scale_log2
    if CAUSAL:
        keep = offs_n[None, :] <= qpos[:, None]
    else:
        keep = n_ok[None, :] & (qpos >= 0)[:, None]
    if WINDOWED:
        keep = keep & (offs_n[None, :] > qpos[:, None] - window)
    s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)  # rows with nothing to see yet stay finite
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if FP8:
        p = p * v_scale[None, :]
    acc = acc * alpha[:, None] + dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), IEEE)
    return acc, m_new, l_i


@triton.jit
def _varlen_kernel(
    out_ptr,
    q_ptr,
    kc_ptr,
    vc_ptr,
    ks_ptr,
    vs_ptr,
    qsl_ptr,
    seq_lens_ptr,
    bt_ptr,
    scale_log2,
    window,
    softcap,
    num_seqs,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_sb,
    stride_ss,
    stride_bt,
    PAGE: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SKIP_DECODES: tl.constexpr,
    FP8: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    IEEE: tl.constexpr,
    WINDOWED: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    seq = find_seq(qsl_ptr, pid, num_seqs, BLOCK_Q)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    q_block = pid - (q_start // BLOCK_Q + seq)
    skip = q_block * BLOCK_Q >= q_len
    if SKIP_DECODES:
        skip = skip | (q_len == 1)
    if skip:
        return
    ctx_len = tl.load(seq_lens_ptr + seq) - q_len  # cached prefix before this step's rows

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    tok = q_block * BLOCK_Q + offs_m // GROUP
    head = kvh * GROUP + offs_m % GROUP
    row_ok = (offs_m < BLOCK_Q * GROUP) & (tok < q_len)
    d_ok = offs_d < HEAD_DIM
    row = (q_start + tok).to(tl.int64)
    q = tl.load(
        q_ptr + row[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    ).to(DOT_DTYPE)
    qpos = tl.where(row_ok, ctx_len + tok, -1)  # absolute positions; -1 sees no key

    kv_end = ctx_len + tl.minimum(q_block * BLOCK_Q + BLOCK_Q, q_len)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    lo = 0
    if WINDOWED:  # the tile's first row sees no key before its window: skip the tiles wholly before it
        lo = tl.maximum(ctx_len + q_block * BLOCK_Q - window + 1, 0) // BLOCK_N * BLOCK_N
    for start in range(lo, kv_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            acc,
            m_i,
            l_i,
            q,
            kc_ptr,
            vc_ptr,
            ks_ptr,
            vs_ptr,
            bt_row,
            kvh,
            start,
            kv_end,
            qpos,
            scale_log2,
            window,
            softcap,
            stride_cb,
            stride_cs,
            stride_ch,
            stride_sb,
            stride_ss,
            PAGE,
            HEAD_DIM,
            D_PAD,
            BLOCK_N,
            True,
            FP8,
            DOT_DTYPE,
            IEEE,
            WINDOWED,
            SOFTCAP,
        )
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + row[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )


@triton.jit
def _decode_kernel(
    out_ptr,
    part_acc_ptr,
    part_ml_ptr,
    q_ptr,
    kc_ptr,
    vc_ptr,
    ks_ptr,
    vs_ptr,
    qsl_ptr,
    seq_lens_ptr,
    bt_ptr,
    scale_log2,
    window,
    softcap,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_sb,
    stride_ss,
    stride_bt,
    stride_pa_seq,
    stride_pa_split,
    stride_pa_h,
    stride_pml_kind,
    stride_pml_seq,
    stride_pml_split,
    PAGE: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT_SIZE: tl.constexpr,
    FP8: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    IEEE: tl.constexpr,
    WINDOWED: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    n_splits = tl.cdiv(seq_len, SPLIT_SIZE)
    if (q_len != 1) | (split >= n_splits):
        return

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    head = kvh * GROUP + offs_m
    row_ok = offs_m < GROUP
    d_ok = offs_d < HEAD_DIM
    q = tl.load(
        q_ptr + q_start.to(tl.int64) * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    ).to(DOT_DTYPE)
    qpos = tl.where(row_ok, seq_len - 1, -1)

    kv_start = split * SPLIT_SIZE
    kv_end = tl.minimum(kv_start + SPLIT_SIZE, seq_len)
    lo = kv_start
    if WINDOWED:  # a split wholly before the window runs no tile: its partial (m -inf, l 0) weighs nothing
        lo = tl.maximum(lo, tl.maximum(seq_len - window, 0) // BLOCK_N * BLOCK_N)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    for start in range(lo, kv_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            acc,
            m_i,
            l_i,
            q,
            kc_ptr,
            vc_ptr,
            ks_ptr,
            vs_ptr,
            bt_row,
            kvh,
            start,
            kv_end,
            qpos,
            scale_log2,
            window,
            softcap,
            stride_cb,
            stride_cs,
            stride_ch,
            stride_sb,
            stride_ss,
            PAGE,
            HEAD_DIM,
            D_PAD,
            BLOCK_N,
            False,
            FP8,
            DOT_DTYPE,
            IEEE,
            WINDOWED,
            SOFTCAP,
        )
    mask = row_ok[:, None] & d_ok[None, :]
    if n_splits == 1:
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + q_start.to(tl.int64) * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=mask,
        )
    else:
        pa = part_acc_ptr + seq.to(tl.int64) * stride_pa_seq + split * stride_pa_split
        tl.store(pa + head[:, None] * stride_pa_h + offs_d[None, :], acc, mask=mask)
        pml = part_ml_ptr + seq.to(tl.int64) * stride_pml_seq + split * stride_pml_split + head
        tl.store(pml, m_i, mask=row_ok)
        tl.store(pml + stride_pml_kind, l_i, mask=row_ok)


@triton.jit
def _combine_kernel(
    out_ptr,
    part_acc_ptr,
    part_ml_ptr,
    qsl_ptr,
    seq_lens_ptr,
    stride_ot,
    stride_oh,
    stride_pa_seq,
    stride_pa_split,
    stride_pa_h,
    stride_pml_kind,
    stride_pml_seq,
    stride_pml_split,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    SPLIT_SIZE: tl.constexpr,
):
    seq = tl.program_id(0)
    h = tl.program_id(1)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    n_splits = tl.cdiv(tl.load(seq_lens_ptr + seq), SPLIT_SIZE)
    if (q_len != 1) | (n_splits <= 1):
        return
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < HEAD_DIM
    pml = part_ml_ptr + seq.to(tl.int64) * stride_pml_seq + h
    pa = part_acc_ptr + seq.to(tl.int64) * stride_pa_seq + h * stride_pa_h + offs_d
    m_max = tl.load(pml)
    for s in range(1, n_splits):
        m_max = tl.maximum(m_max, tl.load(pml + s * stride_pml_split))
    # merged in split order, so the sums depend only on this row's own context length
    total = tl.zeros([D_PAD], tl.float32)
    l_sum = 0.0
    for s in range(0, n_splits):
        w = tl.exp2(tl.load(pml + s * stride_pml_split) - m_max)
        l_sum += w * tl.load(pml + stride_pml_kind + s * stride_pml_split)
        total += w * tl.load(pa + s * stride_pa_split, mask=d_ok, other=0.0)
    o = total / l_sum
    tl.store(
        out_ptr + q_start.to(tl.int64) * stride_ot + h * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty), mask=d_ok
    )


def varlen_tiles(itemsize: int, d_pad: int, group: int) -> tuple[int, int]:
    """BLOCK_M and BLOCK_N of the varlen kernel for dot inputs of `itemsize` bytes at a padded head dim: halved
    (N first) until the tiles fit VARLEN_TILE_BYTES; BLOCK_M holds at least one token's GROUP query heads."""
    block_m, block_n = VARLEN_BLOCK_M, VARLEN_BLOCK_N
    while 2 * (block_m + block_n) * d_pad * itemsize > VARLEN_TILE_BYTES and max(block_m, block_n) > 16:
        if block_n >= block_m:
            block_n //= 2
        else:
            block_m //= 2
    return max(block_m, next_pow2(group)), block_n


def paged_attention_impl(
    q: torch.Tensor,
    k_cache,
    v_cache,
    meta: AttentionMetadata,
    scale: float,
    k_scale_cache=None,
    v_scale_cache=None,
    *,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    split_decodes: bool = True,
    split_size: int = SPLIT_SIZE,
    decode_block_n: int = DECODE_BLOCK_N,
    decode_warps: int = 4,
    varlen_block: tuple[int, int] | None = None,
    varlen_warps: int = 4,
) -> torch.Tensor:
    """paged_attention with the knobs exposed for tests and the device check's tuning sweep: split_decodes=False
    sends every row through the varlen kernel; split_size (a multiple of decode_block_n) sets the decode split
    length; decode_block_n and decode_warps the decode kernel's key tile and warps; varlen_block (BLOCK_M, BLOCK_N)
    and varlen_warps the varlen kernel's (default: varlen_tiles)."""
    check_device(q, k_cache, v_cache)
    T, H, D = q.shape
    _, page, KVH, Dc = k_cache.shape
    assert Dc == D and H % KVH == 0, f"q {tuple(q.shape)} does not fit the cache {tuple(k_cache.shape)}"
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1, "K/V caches need one layout, unit D"
    assert split_size % decode_block_n == 0
    group = H // KVH
    q = q if q.stride(-1) == 1 else q.contiguous()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    num_seqs = meta.num_seqs
    if T == 0 or num_seqs == 0:
        return out
    fp8 = k_cache.dtype == FP8_DTYPE
    if fp8:
        assert k_scale_cache is not None and v_scale_cache is not None, "an fp8 cache needs scale caches"
        assert k_scale_cache.stride() == v_scale_cache.stride() and k_scale_cache.stride(-1) == 1
        kc, vc, ks, vs = k_cache.view(torch.uint8), v_cache.view(torch.uint8), k_scale_cache, v_scale_cache
        stride_sb, stride_ss = ks.stride(0), ks.stride(1)
    else:
        kc, vc, ks, vs = k_cache, v_cache, k_cache, v_cache  # scale pointers unused
        stride_sb = stride_ss = 0
    qsl, seq_lens, bt = meta.query_start_loc, meta.seq_lens, meta.block_tables
    common = dict(
        PAGE=page,
        GROUP=group,
        HEAD_DIM=D,
        D_PAD=next_pow2(D),
        FP8=fp8,
        DOT_DTYPE=dot_dtype(q.dtype),
        IEEE=q.dtype == torch.float32,
        WINDOWED=sliding_window is not None,
        SOFTCAP=logits_soft_cap is not None,
    )
    strides = (
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        stride_sb,
        stride_ss,
        bt.stride(0),
    )
    # soft-capping needs the plain scaled score before its tanh; the kernel then moves to the exp2 domain itself
    scale_log2 = float(scale) * (LOG2E if logits_soft_cap is None else 1.0)
    options = (int(sliding_window or 0), float(logits_soft_cap or 1.0))
    qlens = meta.query_lens_host

    decode_lens = [s for n, s in zip(qlens, meta.seq_lens_host) if n == 1] if split_decodes else []
    if any(n > 1 for n in qlens) or (not split_decodes and any(n == 1 for n in qlens)):
        # by the query's dtype, not the dot's: the interpreter (whose dots are all fp32) runs the GPU's tiles
        block_m, block_n = varlen_block or varlen_tiles(q.element_size(), common["D_PAD"], group)
        assert block_m >= group, "BLOCK_M holds at least one token's query heads"
        block_q = block_m // group
        grid = (T // block_q + num_seqs, KVH)
        _varlen_kernel[grid](
            out,
            q,
            kc,
            vc,
            ks,
            vs,
            qsl,
            seq_lens,
            bt,
            scale_log2,
            *options,
            num_seqs,
            *strides,
            BLOCK_M=block_m,
            BLOCK_Q=block_q,
            BLOCK_N=block_n,
            SKIP_DECODES=split_decodes,
            **common,
            num_warps=varlen_warps,
        )
    if decode_lens:
        max_splits = max(triton.cdiv(s, split_size) for s in decode_lens)
        if max_splits > 1:
            part_acc = torch.empty((num_seqs, max_splits, H, next_pow2(D)), dtype=torch.float32, device=q.device)
            part_ml = torch.empty((2, num_seqs, max_splits, H), dtype=torch.float32, device=q.device)
        else:
            part_acc = part_ml = torch.empty((1, 1, 1, 1), dtype=torch.float32, device=q.device)
        pstrides = (
            part_acc.stride(0),
            part_acc.stride(1),
            part_acc.stride(2),
            part_ml.stride(0),
            part_ml.stride(1),
            part_ml.stride(2),
        )
        _decode_kernel[(num_seqs, KVH, max_splits)](
            out,
            part_acc,
            part_ml,
            q,
            kc,
            vc,
            ks,
            vs,
            qsl,
            seq_lens,
            bt,
            scale_log2,
            *options,
            *strides,
            *pstrides,
            BLOCK_M=max(16, next_pow2(group)),
            BLOCK_N=decode_block_n,
            SPLIT_SIZE=split_size,
            **common,
            num_warps=decode_warps,
        )
        if max_splits > 1:
            _combine_kernel[(num_seqs, H)](
                out,
                part_acc,
                part_ml,
                qsl,
                seq_lens,
                out.stride(0),
                out.stride(1),
                *pstrides,
                HEAD_DIM=D,
                D_PAD=next_pow2(D),
                SPLIT_SIZE=split_size,
                num_warps=1,
            )
    return out


def paged_attention(
    q: torch.Tensor,
    k_cache,
    v_cache,
    meta: AttentionMetadata,
    scale: float,
    k_scale_cache=None,
    v_scale_cache=None,
    *,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Causal attention of the step's query rows q [T, H, D] over each sequence's cached context, read through its
    block table. Prefill chunks run in the varlen kernel, decodes in the split-KV decode kernel. `sliding_window`
    limits a query at position p to the keys in (p - window, p]; `logits_soft_cap` caps the scaled scores s to
    cap * tanh(s / cap). Tiles and splits wholly before a window are skipped, not read."""
    return paged_attention_impl(
        q, k_cache, v_cache, meta, scale, k_scale_cache, v_scale_cache,
        sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
    )  # fmt: skip
