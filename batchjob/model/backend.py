"""The ops a model calls, as a Protocol: `batchjob.model.ops` (torch, the reference), `batchjob.model.cpu_ops` (those
with C++ kernels for float32 and bfloat16 on a CPU) and `batchjob.kernels.ops` (Triton) implement it with the same
signatures; the engine's model runner picks one. A backend may write an rms_norm's x and residual and rotary's q
and k in place: the model never reads them again."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from batchjob.model.attention_metadata import AttentionMetadata
from batchjob.model.lora.slots import LoraBatch


class OpsBackend(Protocol):
    FP8_DTYPE: torch.dtype  # the dtype of an fp8 KV cache
    CAPTURABLE: bool  # no op waits on the host inside a step, so that a CUDA graph can capture one

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...

    def rotary(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor: ...

    def gelu_tanh_and_mul(self, x: torch.Tensor) -> torch.Tensor: ...

    def count_greater(self, x: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor: ...

    def moe_experts(self, gate: list[torch.Tensor], up: list[torch.Tensor], down: list[torch.Tensor]) -> Any:
        """A sparse layer's experts (each expert's gate [I, H], up [I, H], down [H, I]) laid out for fused_moe, once
        at load."""

    def fused_moe(
        self, x: torch.Tensor, experts: Any, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor: ...

    def lora_add(self, x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, batch: LoraBatch) -> None:
        """y[row] += x[row] @ a[slot] @ b[slot] for each row of `batch` with an adapter (a: [slots, in, rank], b:
        [slots, rank, out], one matmul's stacked adapters), in place."""

    def store_kv(self, k, v, k_cache, v_cache, slot_mapping, k_scale_cache=None, v_scale_cache=None) -> None: ...

    def paged_attention(
        self,
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
    ) -> torch.Tensor: ...

    def varlen_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float
    ) -> torch.Tensor: ...
