"""The ops backend on a CPU: the torch ops (ops.py), each float32 or bfloat16 call sent to its C++ kernel
(cpu_native.py) where that is built. Unlike the torch reference, rms_norm with a residual and rotary work in place,
as vLLM's fused add-RMSNorm does: the model never reads their inputs again, and each large tensor a step does not
allocate is page faults it does not take."""

from __future__ import annotations

import torch

from batchjob.model import ops as torch_ops
from batchjob.model.attention_metadata import AttentionMetadata
from batchjob.model.cpu_native import native_ops_for

FP8_DTYPE = torch_ops.FP8_DTYPE
CAPTURABLE = False  # a CPU has no CUDA graphs


def _rows(*ts: torch.Tensor) -> bool:
    return all(t.dim() == 2 and t.is_contiguous() for t in ts)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """ops.rms_norm; with a residual, the sum is written into `residual` and the normed rows into `x`."""
    native = native_ops_for(x.device, x.dtype, weight.dtype, *([] if residual is None else [residual.dtype]))
    if native is None or x.dim() != 2 or x.stride(-1) != 1:
        return torch_ops.rms_norm(x, weight, eps, residual)
    if residual is None:
        return native.rms_norm(x, weight, eps)
    if not _rows(x, residual) or x.shape != residual.shape:
        return torch_ops.rms_norm(x, weight, eps, residual)
    native.add_rms_norm_(x, residual, weight, eps)
    return x, residual


def rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor):
    """ops.rotary, in place on q and k (views of the fused qkv rows) where the C++ kernel takes them."""
    native = native_ops_for(q.device, q.dtype, k.dtype)
    d = q.shape[-1]
    heads_back_to_back = all(t.dim() == 3 and t.stride(2) == 1 and t.stride(1) == d for t in (q, k))
    # the cos/sin table stays float32 whatever the model's dtype (ModelConfig.cos_sin_cache); one narrower than the
    # head is partial rotary, which the kernel does too
    if native is None or not heads_back_to_back or k.shape[-1] != d or cos_sin_cache.dtype != torch.float32:
        return torch_ops.rotary(q, k, positions, cos_sin_cache)
    native.rotary_(q, k, positions, cos_sin_cache)
    return q, k


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    native = native_ops_for(x.device, x.dtype)
    if native is None or x.dim() != 2 or x.stride(-1) != 1:
        return torch_ops.silu_and_mul(x)
    return native.silu_and_mul(x)


def count_greater(x: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    native = native_ops_for(x.device, x.dtype, threshold.dtype)
    if native is None or x.dtype != torch.float32 or x.dim() != 2 or x.stride(-1) != 1:
        return torch_ops.count_greater(x, threshold)
    return native.count_greater(x, threshold)


def fused_moe(x, experts, topk_weights, topk_ids) -> torch.Tensor:
    """ops.fused_moe (each expert's packed Linears), with this module's silu_and_mul between the matmuls."""
    return torch_ops.per_expert_moe(x, experts, topk_weights, topk_ids, silu_and_mul)


moe_experts = torch_ops.moe_experts
lora_add = torch_ops.lora_add  # the adapters' small matmuls: torch's GEMMs and bmm
gelu_tanh_and_mul = torch_ops.gelu_tanh_and_mul  # Gemma's MLP: torch's GELU kernel, no C++ form of its own
varlen_attention = torch_ops.varlen_attention  # an encoder's attention: torch's SDPA per run of one length


def store_kv(k, v, k_cache, v_cache, slot_mapping, k_scale_cache=None, v_scale_cache=None) -> None:
    native = native_ops_for(k.device, k.dtype, v.dtype, k_cache.dtype)
    if native is None:  # an fp8 cache, or other dtypes
        return torch_ops.store_kv(k, v, k_cache, v_cache, slot_mapping, k_scale_cache, v_scale_cache)
    native.store_kv(k, v, k_cache, v_cache, slot_mapping)


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
    """ops.paged_attention; float32 or bfloat16 (q and cache alike) goes to the C++ kernel, one call for all
    sequences, reading blocks in place."""
    native = native_ops_for(q.device, q.dtype, k_cache.dtype)
    if native is None:
        return torch_ops.paged_attention(
            q, k_cache, v_cache, meta, scale, k_scale_cache, v_scale_cache,
            sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
        )  # fmt: skip
    args = (q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale)
    if sliding_window is None and logits_soft_cap is None:
        return native.paged_attention(*args)
    return native.paged_attention(*args, sliding_window or 0, logits_soft_cap or 0.0)
