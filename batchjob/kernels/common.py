"""Shared bits of the Triton kernels."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchjob import env

# triton.jit picks the interpreter when the function is defined, from this variable: read it the same way, once.
INTERPRET = env.get("TRITON_INTERPRET") == "1"
LOG2E = 1.4426950408889634  # the attention kernels' softmax runs in the exp2 domain: scores times scale * LOG2E


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def check_device(*tensors: torch.Tensor) -> None:
    """Triton runs CUDA tensors, or CPU tensors in the interpreter only."""
    for t in tensors:
        if t is not None and t.device.type == "cpu" and not INTERPRET:
            raise RuntimeError(
                "batchjob.kernels.ops got CPU tensors but the Triton interpreter is off: set TRITON_INTERPRET=1 "
                "before importing batchjob.kernels.ops, or use batchjob.model.ops on a CPU"
            )


def dot_dtype(dtype: torch.dtype):
    """The dtype an attention kernel's tl.dot takes for activations of `dtype`."""
    if INTERPRET or dtype == torch.float32:
        return tl.float32  # the interpreter's fp16/bf16 tl.dot is not reliable
    if dtype == torch.float16:
        return tl.float16
    if dtype == torch.bfloat16:
        return tl.bfloat16
    raise TypeError(f"unsupported activation dtype for the attention kernels: {dtype}")


@triton.jit
def dot(a, b, IEEE: tl.constexpr):
    """tl.dot; IEEE (fp32 activations) keeps full fp32 products rather than TF32's."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def find_seq(query_start_loc_ptr, target, num_seqs, BLOCK_Q: tl.constexpr):
    """The last sequence i whose first q block, query_start_loc[i] // BLOCK_Q + i, is <= target: a launch of
    total_rows // BLOCK_Q + num_seqs programs covers every sequence's q blocks, and program `target` finds its own
    without a host-side plan (a program past its sequence's last block has nothing to do)."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first <= target:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def tanh(x):
    """tanh in fp32 from exp(-2|x|), which neither overflows nor cancels near 0."""
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def fp32_to_e4m3_bits(x):
    """fp32 -> float8_e4m3fn bit pattern (uint8), round to nearest even, saturating at +-448 as torch does.
    Used in the interpreter, whose own fp8 cast does not carry a mantissa round-up into the exponent."""
    bits = x.to(tl.uint32, bitcast=True)
    sign = (bits >> 31) & 1
    a = tl.minimum(tl.abs(x), 448.0)
    abits = a.to(tl.uint32, bitcast=True)
    # normal range (a >= 2^-6): keep 3 of fp32's 23 mantissa bits, round half to even; a carry bumps the exponent
    r = (abits + 0x7FFFF + ((abits >> 20) & 1)) & 0xFFF00000
    exp8 = (r >> 23).to(tl.int32) - 127 + 7
    normal = (exp8 << 3) | ((r >> 20) & 7).to(tl.int32)
    # subnormal range: multiples of 2^-9; adding 2^14 (whose fp32 ulp is 2^-9) rounds half to even
    sub = ((a + 16384.0) - 16384.0) * 512.0
    code = tl.where(a >= 0.015625, normal, sub.to(tl.int32))
    return (code | (sign.to(tl.int32) << 7)).to(tl.uint8)
