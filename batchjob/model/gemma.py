"""Gemma 2 and Gemma 3 (text) decoders over the paged KV cache: LlamaModel's fused matmuls and ops backend, with
Gemma's differences (HF's Gemma2Model / Gemma3TextModel):

- RMSNorm scales by (1 + weight); four norms a layer: before and after attention, before and after the MLP;
- the embedding is scaled by sqrt(hidden), that factor rounded to the model's dtype as HF does;
- the MLP is gelu_tanh(gate) * up;
- attention is scaled by query_pre_attn_scalar**-0.5; "sliding_attention" layers see a window of keys, the others
  all of them; Gemma 3 normalises q and k per head before rotary and gives its sliding layers their own rope base;
- Gemma 2 soft-caps attention scores and the logits (cap * tanh(x / cap))."""

from __future__ import annotations

import dataclasses

import torch

from batchjob.model.attention_metadata import AttentionMetadata
from batchjob.model.backend import OpsBackend
from batchjob.model.config import GEMMA_ARCHITECTURES, ModelConfig
from batchjob.model.llama import LlamaModel, embedding
from batchjob.model.lora.slots import LoraBatch


def _one_plus(weight: torch.Tensor) -> torch.Tensor:
    """Gemma's norm weight w as the factor (1 + w) that the ops' RMSNorm multiplies by, added in fp32 as HF does. In
    float32 this is HF's norm exactly; in bf16 the factor and the normalised row are each rounded before their product
    (Llama's order, which the ops share), where HF's Gemma rounds once after it: last-bit differences."""
    return (1.0 + weight.float()).to(weight.dtype)


_EXTRA_NORMS = ("pre_ff_norm", "post_ff_norm")  # a layer's norms beyond Llama's (whose count holds q/k norms)


def decoder_class(config: ModelConfig) -> type[LlamaModel]:
    """The forward pass of the config's architecture."""
    return GemmaModel if config.architecture in GEMMA_ARCHITECTURES else LlamaModel


class GemmaModel(LlamaModel):
    MLP_INPUT_NORM = "pre_ff_norm"  # Gemma's post_norm follows attention's output projection

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        ops: OpsBackend,
        rope_freqs: torch.Tensor | None = None,
        device: torch.device | str = "cpu",
        max_model_len: int | None = None,
        w8a8: bool = False,
        calibration: list[int] | None = None,
    ):
        c = config
        # Read before LlamaModel takes the weights it shares with Llama.
        names = {"pre_ff_norm": "pre_feedforward_layernorm.weight", "post_ff_norm": "post_feedforward_layernorm.weight"}
        if c.architecture == "Gemma3ForCausalLM":
            names |= {"q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight"}
        extra = []
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            extra.append({key: _one_plus(weights[p + name].to(device)) for key, name in names.items()})
        super().__init__(config, weights, ops, rope_freqs, device, max_model_len, w8a8=w8a8, calibration=calibration)
        for layer, more in zip(self.layers, extra):
            layer["input_norm"], layer["post_norm"] = _one_plus(layer["input_norm"]), _one_plus(layer["post_norm"])
            layer.update(more)
        self.norm = _one_plus(self.norm)
        self.normalizer = torch.tensor(c.hidden_size**0.5, dtype=self.norm.dtype, device=self.norm.device)
        self.scale = c.query_pre_attn_scalar**-0.5
        if c.rope_local_base_freq is not None:  # Gemma 3: the sliding layers' rope, never scaled
            local = dataclasses.replace(c, rope_theta=c.rope_local_base_freq, rope_scaling=None)
            self.local_cos_sin_cache = local.cos_sin_cache(c.max_position_embeddings).to(device)
        else:
            self.local_cos_sin_cache = self.cos_sin_cache
        if w8a8:  # after the norms above: smoothing divides their factors (1 + w), and calibration runs forward
            self.quantize_w8a8(calibration)

    def weight_bytes(self) -> int:
        extra = sum(t.nbytes for w in self.layers for key, t in w.items() if key in _EXTRA_NORMS)
        return super().weight_bytes() + extra

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, ...]],
        lora: LoraBatch | None = None,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] of the step's tokens; K/V of every token is written to the cache (LoRA as in
        LlamaModel.forward)."""
        c, ops, eps = self.config, self.ops, self.config.rms_norm_eps
        h = embedding(self.embed, input_ids) * self.normalizer
        residual = None
        for i, (layer, cache) in enumerate(zip(self.layers, kv_caches)):
            if residual is None:
                x, residual = ops.rms_norm(h, layer["input_norm"], eps), h
            else:
                x, residual = ops.rms_norm(h, layer["input_norm"], eps, residual)
            q, k, v = self.project(i, "qkv", x, lora).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            if layer["q_norm"] is not None:  # Gemma 3: per head, over head_dim
                q = ops.rms_norm(q.reshape(-1, c.head_dim), layer["q_norm"], eps)
                k = ops.rms_norm(k.reshape(-1, c.head_dim), layer["k_norm"], eps)
            q = q.reshape(-1, c.num_attention_heads, c.head_dim)
            k = k.reshape(-1, c.num_key_value_heads, c.head_dim)
            v = v.view(-1, c.num_key_value_heads, c.head_dim)
            window = c.layer_window(i)
            q, k = ops.rotary(q, k, positions, self.cos_sin_cache if window is None else self.local_cos_sin_cache)
            k_cache, v_cache, *scales = cache
            ops.store_kv(k, v, k_cache, v_cache, meta.slot_mapping, *scales)
            attn = ops.paged_attention(
                q, k_cache, v_cache, meta, self.scale, *scales,
                sliding_window=window, logits_soft_cap=c.attn_logit_softcapping,
            )  # fmt: skip
            h = ops.rms_norm(self.project(i, "o", attn.view(-1, self.q_size), lora), layer["post_norm"], eps)
            x, residual = ops.rms_norm(h, layer["pre_ff_norm"], eps, residual)
            h = self.project(i, "down", ops.gelu_tanh_and_mul(self.project(i, "gate_up", x, lora)), lora)
            h = ops.rms_norm(h, layer["post_ff_norm"], eps)
        out, _ = ops.rms_norm(h, self.norm, eps, residual)
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def score_tokens(self, hidden: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        # the fused head knows no soft cap
        return super().score_tokens(hidden, targets) if self.config.final_logit_softcapping is None else None
