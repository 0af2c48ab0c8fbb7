"""Llama-family decoder (Llama, Mistral, Qwen2) over a paged KV cache. Numeric ops come from an ops backend
(backend.OpsBackend: `batchjob.model.cpu_ops` on a CPU, `batchjob.kernels.ops` in Triton on a GPU)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from batchjob.model.attention_metadata import AttentionMetadata
from batchjob.model.backend import OpsBackend
from batchjob.model.config import ModelConfig


class LlamaModel:
    """Weights fused for fewer, larger matmuls: q/k/v in one, gate/up in one."""

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        ops: OpsBackend,
        rope_freqs: torch.Tensor | None = None,
        device: torch.device | str = "cpu",
    ):
        self.config, self.ops = config, ops
        c = config
        w = {k: v.to(device) for k, v in weights.items()}
        self.embed = w["model.embed_tokens.weight"]
        self.norm = w["model.norm.weight"]
        self.lm_head = self.embed if c.tie_word_embeddings else w["lm_head.weight"]
        self.layers = []
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            qkv = [w[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]
            bias = [w[p + f"self_attn.{n}_proj.bias"] for n in "qkv"] if c.attention_bias else None
            self.layers.append(
                {
                    "input_norm": w[p + "input_layernorm.weight"],
                    "post_norm": w[p + "post_attention_layernorm.weight"],
                    "qkv": torch.cat(qkv),
                    "qkv_bias": torch.cat(bias) if bias else None,
                    "o": w[p + "self_attn.o_proj.weight"],
                    "gate_up": torch.cat([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]]),
                    "down": w[p + "mlp.down_proj.weight"],
                    # Llama's attention_bias also biases o_proj, and its mlp_bias all three MLP projections.
                    "o_bias": w.get(p + "self_attn.o_proj.bias"),
                    "down_bias": w.get(p + "mlp.down_proj.bias"),
                    "gate_up_bias": (
                        torch.cat([w[p + "mlp.gate_proj.bias"], w[p + "mlp.up_proj.bias"]])
                        if p + "mlp.gate_proj.bias" in w
                        else None
                    ),
                }
            )
        self.q_size = c.num_attention_heads * c.head_dim
        self.kv_size = c.num_key_value_heads * c.head_dim
        self.scale = c.head_dim**-0.5
        self.cos_sin_cache = c.cos_sin_cache(c.max_position_embeddings, rope_freqs).to(device)

    def linear_weights(self, layer: int) -> list[torch.Tensor]:
        """The decoder layer's matmul weights (fused qkv, o, fused gate_up, down), for FLOP counts."""
        w = self.layers[layer]
        return [w["qkv"], w["o"], w["gate_up"], w["down"]]

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, ...]],
    ) -> torch.Tensor:
        """Hidden states [T, hidden] of the step's tokens; K/V of every token is written to the cache."""
        c, ops = self.config, self.ops
        h = F.embedding(input_ids, self.embed)
        residual = None
        for layer, cache in zip(self.layers, kv_caches):
            if residual is None:
                x, residual = ops.rms_norm(h, layer["input_norm"], c.rms_norm_eps), h
            else:
                x, residual = ops.rms_norm(h, layer["input_norm"], c.rms_norm_eps, residual)
            qkv = F.linear(x, layer["qkv"], layer["qkv_bias"])
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = q.view(-1, c.num_attention_heads, c.head_dim)
            k = k.view(-1, c.num_key_value_heads, c.head_dim)
            v = v.view(-1, c.num_key_value_heads, c.head_dim)
            q, k = ops.rotary(q, k, positions, self.cos_sin_cache)
            k_cache, v_cache, *scales = cache
            ops.store_kv(k, v, k_cache, v_cache, meta.slot_mapping, *scales)
            attn = ops.paged_attention(q, k_cache, v_cache, meta, self.scale, *scales)
            h = F.linear(attn.view(-1, self.q_size), layer["o"], layer["o_bias"])
            x, residual = ops.rms_norm(h, layer["post_norm"], c.rms_norm_eps, residual)
            h = F.linear(
                ops.silu_and_mul(F.linear(x, layer["gate_up"], layer["gate_up_bias"])),
                layer["down"],
                layer["down_bias"],
            )
        out, _ = ops.rms_norm(h, self.norm, c.rms_norm_eps, residual)
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.lm_head).float()
