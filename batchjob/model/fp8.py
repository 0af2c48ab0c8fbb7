"""The fp8 KV-cache format, shared by the torch ops and the Triton kernels: float8_e4m3fn values with one fp32
scale per (token, head)."""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite float8_e4m3fn


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-(token, head) scale: x [T, KVH, D] -> (fp8 values, scale [T, KVH])."""
    scale = x.float().abs().amax(dim=-1).clamp(min=1e-6) / FP8_MAX
    return (x.float() / scale.unsqueeze(-1)).to(FP8_DTYPE), scale
