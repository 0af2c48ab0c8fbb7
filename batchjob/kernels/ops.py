"""Triton forms of batchjob.model.ops: same names, arguments and results. The model runner picks this module on a CUDA
device; on a CPU it runs only in Triton's interpreter (TRITON_INTERPRET=1 set before this module is imported).

FP8 caches (float8_e4m3fn, per-(slot, head) scales) need sm_89 or newer (H100/H200/L40/RTX 40xx)."""

from __future__ import annotations

import torch

from batchjob.kernels.attention import paged_attention
from batchjob.kernels.elementwise import gelu_tanh_and_mul, rms_norm, rotary, silu_and_mul
from batchjob.kernels.encoder_attention import varlen_attention
from batchjob.kernels.kv_cache import store_kv
from batchjob.kernels.lora import lora_add
from batchjob.kernels.moe import fused_moe
from batchjob.model.fp8 import FP8_DTYPE  # either ops module names the fp8 cache dtype it writes
from batchjob.model.moe import StackedExperts as moe_experts  # the grouped GEMM's layout: [E, 2I, H] and [E, H, I]


def count_greater(x: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """As batchjob.model.ops.count_greater: torch's own reduction serves on a GPU."""
    return (x > threshold).sum(-1)


# The wrappers size every launch from host values and never read a device tensor: a CUDA graph can capture a step.
CAPTURABLE = True

__all__ = [
    "rms_norm",
    "rotary",
    "silu_and_mul",
    "gelu_tanh_and_mul",
    "count_greater",
    "store_kv",
    "paged_attention",
    "varlen_attention",
    "moe_experts",
    "fused_moe",
    "lora_add",
    "FP8_DTYPE",
    "CAPTURABLE",
]
