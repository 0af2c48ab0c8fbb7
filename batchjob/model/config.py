"""The architecture facts the runner needs, read from an HF config.json or GGUF metadata."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

# Gemma 2 and 3 run in gemma.py (GemmaModel); the rest in llama.py.
GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM", *GEMMA_ARCHITECTURES)
SUPPORTED_ARCHITECTURES += ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM")
SUPPORTED_ARCHITECTURES += ("Phi3ForCausalLM",)
# GGUF's general.architecture -> HF's name. Mistral GGUFs say "llama" (Mixtral's too: "llama" with experts).
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}
GGUF_ARCHITECTURES |= {"gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}
GGUF_ARCHITECTURES |= {"qwen3": "Qwen3ForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM"}
GGUF_ARCHITECTURES |= {"phi3": "Phi3ForCausalLM"}
# q/k RMSNorm per head before rotary (HF's q_norm/k_norm; Gemma 3's are gemma.py's)
QK_NORM_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
# Checkpoints that store q/k/v as one qkv_proj and gate/up as one gate_up_proj (Phi-3): the fused matmuls as they are.
FUSED_CHECKPOINTS = ("Phi3ForCausalLM",)
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
    # Mistral v0.1 and Phi-3-mini-4k (no layer_types): every layer's window, and the engine caps the context to it.
    # With layer_types: the window of the "sliding_attention" layers, served by the attention (a query at p sees keys
    # in (p - w, p]).
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # Sparse MoE MLPs (Qwen3-MoE, Mixtral): num_experts 0 is a dense model. Which layers are sparse: HF's
    # decoder_sparse_step and mlp_only_layers (Qwen3-MoE's; Mixtral's layers are all sparse).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # the top-k routing weights renormalised to sum to 1
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    partial_rotary_factor: float = 1.0  # rotary on the first head_dim * this dims of each head (Phi-4-mini: 0.75)
    # Gemma 2 and 3, with HF's names: each layer's "sliding_attention" or "full_attention"; the attention scale
    # query_pre_attn_scalar**-0.5; tanh soft-capping of attention scores and of the logits; Gemma 3's rope theta of the
    # sliding layers (rope_theta and rope_scaling are the full layers').
    layer_types: tuple[str, ...] | None = None
    query_pre_attn_scalar: int | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    rope_local_base_freq: float | None = None

    def __post_init__(self):
        # a config read back from JSON (the GGUF conversion cache) holds lists
        object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))
        if self.layer_types is not None:
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
            if len(self.layer_types) != self.num_hidden_layers or not self.sliding_window:
                raise ValueError("layer_types needs one entry a layer and a sliding_window")
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture {self.architecture!r} is not supported; supported: {SUPPORTED_ARCHITECTURES}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(f"partial_rotary_factor {self.partial_rotary_factor} gives an odd or empty rotary part")
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
        kind = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type"))
        if kind in (None, "default"):
            rope_scaling = None
        elif kind in ("longrope", "su"):  # "su" is LongRoPE's first name (Phi-3's early configs)
            # Phi-3 keeps the pretraining length beside rope_scaling; transformers gives that one priority.
            original = (
                cfg.get("original_max_position_embeddings")
                or rope_scaling.get("original_max_position_embeddings")
                or cfg.get("max_position_embeddings", 4096)
            )
            rope_scaling = {**rope_scaling, "rope_type": "longrope", "original_max_position_embeddings": original}
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
            partial_rotary_factor=float(
                cfg.get("partial_rotary_factor") or (cfg.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0)
            ),
            **_moe_fields(arch, cfg),
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

    @property
    def qk_norm(self) -> bool:
        return self.architecture in QK_NORM_ARCHITECTURES

    def is_moe_layer(self, layer: int) -> bool:
        """HF's test (Qwen3MoeDecoderLayer): sparse unless listed in mlp_only_layers or off the sparse step."""
        return (
            self.num_experts > 0 and layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0
        )

    @property
    def rotary_dim(self) -> int:
        """How many leading dims of each head rotary turns; the rest pass through."""
        return int(self.head_dim * self.partial_rotary_factor)

    def inv_freq(self, seq_len: int | None = None) -> torch.Tensor:
        """[rotary_dim / 2] inverse frequencies. `seq_len` picks LongRoPE's factors as transformers does: the long
        ones past original_max_position_embeddings, else (and when None) the short ones."""
        d = self.rotary_dim
        inv = 1.0 / (self.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        rs = self.rope_scaling
        if not rs:
            return inv
        kind = rs.get("rope_type", rs.get("type"))
        if kind == "longrope":
            if not len(rs["short_factor"]) == len(rs["long_factor"]) == len(inv):
                raise ValueError(f"rope_scaling longrope: short_factor and long_factor need {len(inv)} values each")
            long = seq_len is not None and seq_len > rs["original_max_position_embeddings"]
            return inv / torch.tensor(rs["long_factor" if long else "short_factor"], dtype=torch.float64)
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
        raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: linear, llama3, longrope)")

    def attention_factor(self) -> float:
        """What LongRoPE multiplies cos and sin by (1 for every other rotary): sqrt(1 + ln(s) / ln(original)), s the
        context's growth over pretraining, as transformers and vLLM compute it."""
        rs = self.rope_scaling or {}
        if rs.get("rope_type") != "longrope":
            return 1.0
        if rs.get("attention_factor") is not None:
            return float(rs["attention_factor"])
        original = rs["original_max_position_embeddings"]
        scale = rs.get("factor") or self.max_position_embeddings / original
        return math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0

    def cos_sin_cache(
        self, max_positions: int, rope_freqs: torch.Tensor | None = None, max_model_len: int | None = None
    ) -> torch.Tensor:
        """[max_positions, rotary_dim]: cos then sin, in fp32. `rope_freqs` is GGUF's per-frequency divisor.

        LongRoPE's long factors serve every position when the context the engine allows (`max_model_len`, default
        max_position_embeddings) goes past original_max_position_embeddings, the short ones otherwise, as vLLM and
        llama.cpp choose. transformers switches per forward call instead (long once a sequence is longer), which
        leaves a sequence that grows past the original length with keys of both kinds in its cache, and would make a
        row's result depend on how it was batched or chunked."""
        inv = self.inv_freq(max_model_len or self.max_position_embeddings)
        if rope_freqs is not None:
            inv = inv / rope_freqs.double()
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv)
        return (torch.cat((freqs.cos(), freqs.sin()), dim=-1) * self.attention_factor()).float()


def _moe_fields(arch: str, cfg: dict) -> dict:
    if arch == "MixtralForCausalLM":  # every layer sparse, its intermediate_size the experts', top-k renormalised
        return dict(
            num_experts=cfg["num_local_experts"],
            num_experts_per_tok=cfg["num_experts_per_tok"],
            moe_intermediate_size=cfg["intermediate_size"],
            norm_topk_prob=True,
        )
    if arch == "Qwen3MoeForCausalLM":  # transformers 5 writes num_experts as num_local_experts
        return dict(
            num_experts=cfg.get("num_experts") or cfg["num_local_experts"],
            num_experts_per_tok=cfg["num_experts_per_tok"],
            moe_intermediate_size=cfg["moe_intermediate_size"],
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            decoder_sparse_step=cfg.get("decoder_sparse_step", 1),
            mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()),
        )
    return {}


def moe_weight_names(c: ModelConfig, layer: int) -> tuple[str, list[tuple[str, str, str]]]:
    """A sparse layer's HF parameter names: the router's, and each expert's (gate, up, down)."""
    if c.architecture == "MixtralForCausalLM":
        p, projs = f"model.layers.{layer}.block_sparse_moe.", ("w1", "w3", "w2")
    else:
        p, projs = f"model.layers.{layer}.mlp.", ("gate_proj", "up_proj", "down_proj")
    return p + "gate.weight", [tuple(p + f"experts.{e}.{w}.weight" for w in projs) for e in range(c.num_experts)]


def weight_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF parameter names and shapes of a Llama-family model (Phi-3's fused projections under their own names)."""
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
        fused = c.architecture in FUSED_CHECKPOINTS
        qkv = {"qkv_proj": q + 2 * kv} if fused else {"q_proj": q, "k_proj": kv, "v_proj": kv}
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}
        shapes |= {p + f"self_attn.{n}.weight": (rows, h) for n, rows in qkv.items()}
        shapes[p + "self_attn.o_proj.weight"] = (h, q)
        if c.is_moe_layer(i):
            router, experts = moe_weight_names(c, i)
            shapes[router] = (c.num_experts, h)
            for gate, up, down in experts:
                e = c.moe_intermediate_size
                shapes |= {gate: (e, h), up: (e, h), down: (h, e)}
        else:
            gate_up = {"gate_up_proj": 2 * inter} if fused else {"gate_proj": inter, "up_proj": inter}
            shapes |= {p + f"mlp.{n}.weight": (rows, h) for n, rows in gate_up.items()}
            shapes[p + "mlp.down_proj.weight"] = (h, inter)
        if c.qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (c.head_dim,), p + "self_attn.k_norm.weight": (c.head_dim,)}
        if c.attention_bias:
            shapes |= {p + f"self_attn.{n}_proj.bias": (size,) for n, size in (("q", q), ("k", kv), ("v", kv))}
        if c.architecture in GEMMA_ARCHITECTURES:  # the norms before and after the MLP ("sandwich")
            shapes |= {p + f"{n}_feedforward_layernorm.weight": (h,) for n in ("pre", "post")}
        if c.architecture == "Gemma3ForCausalLM":
            shapes |= {p + f"self_attn.{n}_norm.weight": (c.head_dim,) for n in "qk"}
    return shapes
