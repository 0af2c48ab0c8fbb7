"""Write the step's K/V rows into the paged cache, quantizing to fp8 (e4m3) with per-(slot, head) scales."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchjob.kernels.common import INTERPRET, check_device, fp32_to_e4m3_bits, next_pow2
from batchjob.model.fp8 import FP8_DTYPE


@triton.jit
def _store_one(
    x_ptr,
    cache_ptr,
    scale_ptr,
    t,
    slot,
    n_heads,
    stride_xt,
    stride_xh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_sb,
    stride_ss,
    PAGE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    H_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
    FP8: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    h = tl.arange(0, H_PAD)
    d = tl.arange(0, D_PAD)
    hok = h < n_heads
    ok = hok[:, None] & (d < HEAD_DIM)[None, :]
    x = tl.load(x_ptr + t * stride_xt + h[:, None] * stride_xh + d[None, :], mask=ok, other=0.0)
    block = slot // PAGE
    off = slot % PAGE
    dst = cache_ptr + block * stride_cb + off * stride_cs + h[:, None] * stride_ch + d[None, :]
    if FP8:
        xf = x.to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(xf), axis=1), 1e-6)
        scale = tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32))  # = torch's amax / 448
        y = tl.math.div_rn(xf, scale[:, None])
        if INTERPRET:
            bits = fp32_to_e4m3_bits(y)
        else:
            bits = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        tl.store(dst, bits, mask=ok)  # the fp8 cache is passed as its uint8 view
        tl.store(scale_ptr + block * stride_sb + off * stride_ss + h, scale, mask=hok)
    else:
        tl.store(dst, x.to(cache_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    kc_ptr,
    vc_ptr,
    ks_ptr,
    vs_ptr,
    slot_ptr,
    n_heads,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_sb,
    stride_ss,
    PAGE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    H_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
    FP8: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        _store_one(
            k_ptr,
            kc_ptr,
            ks_ptr,
            t,
            slot,
            n_heads,
            stride_kt,
            stride_kh,
            stride_cb,
            stride_cs,
            stride_ch,
            stride_sb,
            stride_ss,
            PAGE,
            HEAD_DIM,
            H_PAD,
            D_PAD,
            FP8,
            INTERPRET,
        )
        _store_one(
            v_ptr,
            vc_ptr,
            vs_ptr,
            t,
            slot,
            n_heads,
            stride_vt,
            stride_vh,
            stride_cb,
            stride_cs,
            stride_ch,
            stride_sb,
            stride_ss,
            PAGE,
            HEAD_DIM,
            H_PAD,
            D_PAD,
            FP8,
            INTERPRET,
        )


def store_kv(k, v, k_cache, v_cache, slot_mapping, k_scale_cache=None, v_scale_cache=None) -> None:
    """Write the step's K/V rows into the paged cache [num_blocks, block_size, KVH, D] at slot_mapping
    (slots < 0 are skipped). An fp8 cache also stores per-(slot, head) scales [num_blocks, block_size, KVH]."""
    check_device(k, v, k_cache, v_cache)
    T, KVH, D = k.shape
    if T == 0:
        return
    assert k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride(), "K and V caches differ in layout"
    assert k_cache.stride(-1) == 1, "the cache's head dim must be contiguous"
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    fp8 = k_cache.dtype == FP8_DTYPE
    if fp8:
        assert k_scale_cache is not None and v_scale_cache is not None, "an fp8 cache needs scale caches"
        assert k_scale_cache.stride() == v_scale_cache.stride() and k_scale_cache.stride(-1) == 1
        kc, vc, ks, vs = k_cache.view(torch.uint8), v_cache.view(torch.uint8), k_scale_cache, v_scale_cache
    else:
        kc, vc, ks, vs = k_cache, v_cache, k_cache, v_cache  # scale pointers unused
    _store_kv_kernel[(T,)](
        k,
        v,
        kc,
        vc,
        ks,
        vs,
        slot_mapping,
        KVH,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        ks.stride(0) if fp8 else 0,
        ks.stride(1) if fp8 else 0,
        PAGE=k_cache.shape[1],
        HEAD_DIM=D,
        H_PAD=next_pow2(KVH),
        D_PAD=next_pow2(D),
        FP8=fp8,
        INTERPRET=INTERPRET,
        num_warps=4,
    )
