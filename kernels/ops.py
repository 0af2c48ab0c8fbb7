"""Triton forms of batchjob.ops: same names, arguments and results. The model runner picks this module on a CUDA
device; on a CPU it runs only in Triton's interpreter (TRITON_INTERPRET=1 set before this module is imported)."""
from __future__ import annotations

from kernels.attention import paged_attention
from kernels.elementwise import rms_norm, rotary, silu_and_mul
from kernels.kv_cache import store_kv

__all__ = ["rms_norm", "rotary", "silu_and_mul", "store_kv", "paged_attention"]
