"""The architecture facts the runner needs, read from an HF config.json or GGUF metadata."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

# Gemma 2 and 3 run in gemma.py (GemmaModel); the rest in llama.py.
GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM", *GEMMA_ARCHITECTURES)
# GGUF's general.architecture -> HF's name. Mistral GGUFs say "llama".
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
# Every how many layers a Gemma layer is global (full attention) when the config gives no layer_types: HF's defaults.
_GEMMA_SLIDING_PATTERN = {"Gemma2ForCausalLM": 2, "Gemma3ForCausalLM": 6}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    rope_scaling: dict | None = None
    # Mistral v0.1 (no layer_types): every layer's window, and the engine caps the context to it. With layer_types:
    # the window of the "sliding_attention" layers, served by the attention (a query at p sees keys in (p - w, p]).
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # Gemma 2 and 3, with HF's names: each layer's "sliding_attention" or "full_attention"; the attention scale
    # query_pre_attn_scalar**-0.5; tanh soft-capping of attention scores and of the logits; Gemma 3's rope theta of the
    # sliding layers (rope_theta and rope_scaling are the full layers').
    layer_types: tuple[str, ...] | None = None
    query_pre_attn_scalar: int | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    rope_local_base_freq: float | None = None

    def __post_init__(self):
        if self.layer_types is not None:  # a list when read back from JSON (the GGUF cache's config.json)
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
            if len(self.layer_types) != self.num_hidden_layers or not self.sliding_window:
                raise ValueError("layer_types needs one entry a layer and a sliding_window")
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture {self.architecture!r} is not supported; supported: {SUPPORTED_ARCHITECTURES}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.rope_scaling:
            self.inv_freq()  # an unsupported or incomplete rope_scaling fails with the config, not at the first step

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of a layer whose attention applies one (None: full causal attention)."""
        if self.layer_types is None or self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window

    @property
    def context_window(self) -> int | None:
        """A window every layer shares (Mistral v0.1): the engine caps the context to it, which keeps results exact."""
        return self.sliding_window if self.layer_types is None else None

    @classmethod
    def from_hf(cls, cfg: dict) -> ModelConfig:
        arch = (cfg.get("architectures") or ["?"])[0]
        if arch in GEMMA_ARCHITECTURES:
            return cls._from_hf_gemma(arch, cfg)
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        rope_scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
        rope_theta = cfg.get("rope_theta") or (rope_scaling or {}).get("rope_theta", 10000.0)
        if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) in (None, "default"):
            rope_scaling = None
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases; Llama says so in its config.
            attention_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
            rope_scaling=rope_scaling,
            sliding_window=cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=tuple(eos if isinstance(eos, list) else [eos] if eos is not None else []),
        )

    @classmethod
    def _from_hf_gemma(cls, arch: str, cfg: dict) -> ModelConfig:
        """Gemma's rope comes per layer type (transformers 5: rope_parameters[layer type]; older configs: rope_theta,
        rope_scaling and rope_local_base_freq), its window pattern as layer_types or sliding_window_pattern."""
        n = cfg["num_hidden_layers"]
        rope = cfg.get("rope_parameters") or {}
        gemma2 = arch == "Gemma2ForCausalLM"
        if "full_attention" in rope:
            full, local = rope["full_attention"], rope.get("sliding_attention") or {}
        else:  # one rope for all layers (Gemma 2), or an older config's keys
            full = rope or {**(cfg.get("rope_scaling") or {}), "rope_theta": cfg.get("rope_theta")}
            local = {"rope_theta": cfg.get("rope_local_base_freq")}
        if full.get("rope_theta") is None:  # HF's defaults
            full = {**full, "rope_theta": 10000.0 if gemma2 else 1e6}
        if full.get("rope_type", full.get("type")) in (None, "default"):
            rope_scaling = None
        else:
            rope_scaling = {k: v for k, v in full.items() if k != "rope_theta"}
        pattern = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern")
        pattern = pattern or _GEMMA_SLIDING_PATTERN[arch]
        layer_types = cfg.get("layer_types") or [
            "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)
        ]
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"hidden_activation {act!r} is not supported for {arch} (gelu_pytorch_tanh is)")
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        eos = cfg.get("eos_token_id")
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=n,
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(full.get("rope_theta", 10000.0)),
            max_position_embeddings=cfg.get("max_position_embeddings", 8192),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            rope_scaling=rope_scaling,
            sliding_window=cfg.get("sliding_window") or 4096,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=tuple(eos if isinstance(eos, list) else [eos] if eos is not None else []),
            layer_types=tuple(layer_types),
            query_pre_attn_scalar=int(cfg.get("query_pre_attn_scalar") or 256),
            attn_logit_softcapping=cfg.get("attn_logit_softcapping", 50.0 if gemma2 else None),
            final_logit_softcapping=cfg.get("final_logit_softcapping", 30.0 if gemma2 else None),
            rope_local_base_freq=None if gemma2 else float(local.get("rope_theta") or 10000.0),
        )

    def inv_freq(self) -> torch.Tensor:
        d = self.head_dim
        inv = 1.0 / (self.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        rs = self.rope_scaling
        if not rs:
            return inv
        kind = rs.get("rope_type", rs.get("type"))
        if kind == "linear":
            return inv / rs["factor"]
        if kind == "llama3":
            factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
            old = rs["original_max_position_embeddings"]
            wavelen = 2 * math.pi / inv
            smooth = (old / wavelen - low) / (high - low)
            scaled = torch.where(wavelen > old / low, inv / factor, inv)
            mid = (wavelen <= old / low) & (wavelen >= old / high)
            return torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
        raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: linear, llama3)")

    def cos_sin_cache(self, max_positions: int, rope_freqs: torch.Tensor | None = None) -> torch.Tensor:
        """[max_positions, head_dim]: cos then sin, in fp32. `rope_freqs` is GGUF's per-frequency divisor."""
        inv = self.inv_freq()
        if rope_freqs is not None:
            inv = inv / rope_freqs.double()
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv)
        return torch.cat((freqs.cos(), freqs.sin()), dim=-1).float()


def weight_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF parameter names and shapes of a Llama-family model."""
    h, q, kv, inter = (
        c.hidden_size,
        c.num_attention_heads * c.head_dim,
        c.num_key_value_heads * c.head_dim,
        c.intermediate_size,
    )
    shapes = {"model.embed_tokens.weight": (c.vocab_size, h), "model.norm.weight": (h,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, h)
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        }
        if c.attention_bias:
            shapes |= {p + f"self_attn.{n}_proj.bias": (size,) for n, size in (("q", q), ("k", kv), ("v", kv))}
        if c.architecture in GEMMA_ARCHITECTURES:  # the norms before and after the MLP ("sandwich")
            shapes |= {p + f"{n}_feedforward_layernorm.weight": (h,) for n in ("pre", "post")}
        if c.architecture == "Gemma3ForCausalLM":
            shapes |= {p + f"self_attn.{n}_norm.weight": (c.head_dim,) for n in "qk"}
    return shapes
