"""RMSNorm (with fused residual add), rotary embedding and SiLU-and-multiply."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchjob.kernels.common import check_device, next_pow2, tanh


# ---------------------------------------------------------------------------------------------------------- RMSNorm
@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    n_cols,
    eps,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    # All arithmetic in fp32, rounded to the activation dtype where the torch form rounds (fp16/bf16 products and
    # sums of two values are exact in fp32, so one rounding gives torch's result).
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=ok)  # the new residual
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    y = (xf * inv).to(x.dtype).to(tl.float32) * w
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=ok)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, n] with unit stride along n (a view when possible)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """RMSNorm; with `residual`, first adds it to x and returns (normed, x + residual) as HF's decoder layer does."""
    check_device(x, weight, residual)
    n = x.shape[-1]
    x2 = _rows(x)
    act_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    out = torch.empty(x.shape, dtype=torch.promote_types(act_dtype, weight.dtype), device=x.device)
    o2 = out.view(-1, n)
    if residual is not None:
        r2 = _rows(residual)
        res_out = torch.empty(x.shape, dtype=act_dtype, device=x.device)
        ro2 = res_out.view(-1, n)
    else:
        r2 = ro2 = res_out = x2
    w = weight.contiguous()
    rows = x2.shape[0]
    if rows:
        block = next_pow2(n)
        _rms_norm_kernel[(rows,)](
            x2,
            r2,
            w,
            o2,
            ro2,
            n,
            float(eps),
            x2.stride(0),
            r2.stride(0),
            o2.stride(0),
            ro2.stride(0),
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            num_warps=4 if block <= 2048 else 8,
        )
    return out if residual is None else (out, res_out)


# ----------------------------------------------------------------------------------------------------------- rotary
@triton.jit
def _rotary_one(
    x_ptr,
    o_ptr,
    t,
    stride_xt,
    stride_xh,
    stride_ot,
    stride_oh,
    n_heads,
    cos,
    sin,
    HALF: tl.constexpr,
    H_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr,
    PASS: tl.constexpr,
    PASS_PAD: tl.constexpr,
):
    h = tl.arange(0, H_PAD)
    d = tl.arange(0, HALF_PAD)
    ok = (h < n_heads)[:, None] & (d < HALF)[None, :]
    src = x_ptr + t * stride_xt + h[:, None] * stride_xh + d[None, :]
    x1 = tl.load(src, mask=ok, other=0.0)
    x2 = tl.load(src + HALF, mask=ok, other=0.0)
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    o1 = x1f * cos[None, :] - x2f * sin[None, :]
    o2 = x2f * cos[None, :] + x1f * sin[None, :]
    dst = o_ptr + t * stride_ot + h[:, None] * stride_oh + d[None, :]
    tl.store(dst, o1.to(o_ptr.dtype.element_ty), mask=ok)
    tl.store(dst + HALF, o2.to(o_ptr.dtype.element_ty), mask=ok)
    if PASS > 0:  # partial rotary: the head's dims past the rotary part are copied as they are
        e = tl.arange(0, PASS_PAD)
        ok_pass = (h < n_heads)[:, None] & (e < PASS)[None, :]
        tail = tl.load(x_ptr + t * stride_xt + h[:, None] * stride_xh + 2 * HALF + e[None, :], mask=ok_pass)
        tl.store(o_ptr + t * stride_ot + h[:, None] * stride_oh + 2 * HALF + e[None, :], tail, mask=ok_pass)


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    qo_ptr,
    ko_ptr,
    pos_ptr,
    cache_ptr,
    n_q_heads,
    n_k_heads,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_qot,
    stride_qoh,
    stride_kot,
    stride_koh,
    stride_cache,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    HQ_PAD: tl.constexpr,
    HK_PAD: tl.constexpr,
    PASS: tl.constexpr,
    PASS_PAD: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, HALF_PAD)
    dok = d < HALF
    cos = tl.load(cache_ptr + pos * stride_cache + d, mask=dok, other=0.0).to(tl.float32)
    sin = tl.load(cache_ptr + pos * stride_cache + HALF + d, mask=dok, other=0.0).to(tl.float32)
    _rotary_one(
        q_ptr, qo_ptr, t, stride_qt, stride_qh, stride_qot, stride_qoh, n_q_heads, cos, sin, HALF, HQ_PAD, HALF_PAD,
        PASS, PASS_PAD,
    )  # fmt: skip
    _rotary_one(
        k_ptr, ko_ptr, t, stride_kt, stride_kh, stride_kot, stride_koh, n_k_heads, cos, sin, HALF, HK_PAD, HALF_PAD,
        PASS, PASS_PAD,
    )  # fmt: skip


def _unit_last(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor):
    """Rotary embedding in the neox/HF layout (halves, not interleaved pairs).
    q [T, H, D], k [T, KVH, D], cos_sin_cache [max_pos, R]: cos in the first R/2 columns, sin in the rest; the first
    R dims of each head turn, the other D - R (partial rotary) are copied."""
    check_device(q, k, positions, cos_sin_cache)
    T, H, D = q.shape
    KVH = k.shape[1]
    q, k, cache = _unit_last(q), _unit_last(k), _unit_last(cos_sin_cache)
    qo = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    ko = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if T:
        half = cache.shape[-1] // 2
        pos = positions.reshape(-1)
        _rotary_kernel[(T,)](
            q,
            k,
            qo,
            ko,
            pos,
            cache,
            H,
            KVH,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            qo.stride(0),
            qo.stride(1),
            ko.stride(0),
            ko.stride(1),
            cache.stride(0),
            HALF=half,
            HALF_PAD=next_pow2(half),
            HQ_PAD=next_pow2(H),
            HK_PAD=next_pow2(KVH),
            PASS=D - 2 * half,
            PASS_PAD=next_pow2(D - 2 * half),
            num_warps=4,
        )
    return qo, ko


# ------------------------------------------------------------------------------------------------------ SiLU-and-mul
@triton.jit
def _act_and_mul_kernel(x_ptr, out_ptr, n, stride_x, stride_o, GELU_TANH: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n
    gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    up = tl.load(x_ptr + row * stride_x + n + cols, mask=ok, other=0.0)
    g = gate.to(tl.float32)
    if GELU_TANH:
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)  # sqrt(2 / pi) * (x + 0.044715 x^3)
        act = 0.5 * g * (1.0 + tanh(inner))
    else:
        act = g / (1.0 + tl.exp(-g))
    # the activation is rounded to the activation dtype before the product, as F.silu(gate) * up (or F.gelu's) does
    act = act.to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (act * up.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=ok)


def _act_and_mul(x: torch.Tensor, gelu_tanh: bool) -> torch.Tensor:
    check_device(x)
    n = x.shape[-1] // 2
    x2 = _rows(x)
    out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    o2 = out.view(-1, n)
    rows = x2.shape[0]
    if rows and n:
        block = min(1024, next_pow2(n))
        _act_and_mul_kernel[(rows, triton.cdiv(n, block))](
            x2, o2, n, x2.stride(0), o2.stride(0), GELU_TANH=gelu_tanh, BLOCK=block, num_warps=4
        )
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] holds gate then up; returns silu(gate) * up."""
    return _act_and_mul(x, gelu_tanh=False)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] holds gate then up; returns gelu_tanh(gate) * up (Gemma's MLP)."""
    return _act_and_mul(x, gelu_tanh=True)
