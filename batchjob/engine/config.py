"""Engine settings, validated at construction; a bad value names its field."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from batchjob.engine.sampling_params import SEED_RANGE

# Presets: offline throughput admits until KV is nearly full; latency keeps headroom and smaller steps.
PROFILES = {
    "throughput": {"kv_watermark": 0.95, "max_num_batched_tokens": 2048, "max_num_seqs": 256},
    "latency": {"kv_watermark": 0.75, "max_num_batched_tokens": 512, "max_num_seqs": 64},
}
# Past any host's use, and small enough for the C integers they end in (thread counts, slice bounds, tensor sizes).
MAX_NUM_SEQS = 1 << 16
MAX_NUM_THREADS = 4096


class LoraConfig(BaseModel):
    """LoRA adapters a request may name (vLLM's --lora-modules, max_loras, max_lora_rank)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    adapters: dict[str, str] = Field(description="name: a PEFT adapter folder (adapter_config.json, safetensors)")
    max_loras: int = Field(8, ge=1, le=256, description="adapters held at once; the rows of a step name at most these")
    max_lora_rank: int = Field(64, ge=1, le=1024, description="the largest rank an adapter may have")

    @field_validator("adapters")
    @classmethod
    def _names(cls, adapters: dict[str, str]) -> dict[str, str]:
        if not adapters:
            raise ValueError("name at least one adapter")
        for name in adapters:
            if not name.strip() or name != name.strip():
                raise ValueError(f"adapter name {name!r}: a name without leading or trailing spaces")
        return adapters


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    profile: Literal["throughput", "latency"] = "throughput"
    max_num_seqs: int | None = Field(None, ge=1, le=MAX_NUM_SEQS, description="upper bound on sequences per step")
    max_num_batched_tokens: int | Literal["auto"] | None = Field(
        None, description="token budget of one step, or 'auto' to tune it while running (token_budget.py)"
    )
    max_model_len: int | None = Field(None, ge=16, description="context limit; default the model's")
    block_size: int = Field(16, ge=1, le=256)
    kv_cache_memory_gb: float | None = Field(
        None,
        gt=0,
        description="KV pool on a CPU; default: 2 GiB or half the available memory, a job shrinks it to its needs",
    )
    kv_cache_memory_fraction: float = Field(
        0.9, gt=0, le=1, description="share of GPU memory for weights, activations, CUDA graphs and KV"
    )
    num_kv_blocks: int | None = Field(None, ge=1, lt=2**31, description="overrides the memory-derived pool size")
    kv_cache_dtype: Literal["auto", "fp8"] = "auto"
    kv_watermark: float | None = Field(None, gt=0, le=1, description="stop admitting prefills above this KV usage")
    enable_prefix_caching: bool = True
    preemption_policy: Literal["newest", "longest_remaining"] = "newest"
    preemption_rate_threshold: float = Field(5.0, ge=0, description="preemptions per 100 steps that throttle admission")
    max_bypass: int = Field(16, ge=0, description="later requests admitted ahead of one that does not fit")
    elastic_compression: bool = False
    elastic_max_tokens_floor: int = Field(16, ge=1)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    ops_backend: Literal["auto", "torch", "triton"] = "auto"
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    weights: Literal["auto", "dequantize", "quantized", "int8", "int4", "w8a8"] = Field(
        "auto",
        description="dequantize: the matmuls in `dtype` on dequantized weights; quantized: a GGUF's weight matrices "
        "kept in their quantized blocks, dequantized a panel at a time inside the matmul (a CPU with AVX-512); int8 / "
        "int4: weight-only, each decoder layer's weight matrices quantized at load (int8 symmetric, int4 with a zero, "
        "a scale per group of 32) and computed as `quantized` computes blocks, activations in `dtype` (a CPU with "
        "AVX-512); w8a8: int8 matmuls on a CPU, weights per output channel and activations per token; auto: "
        "dequantize where the dequantized weights fit in half the available memory, else a GGUF's blocks kept "
        "quantized (docs/cpu.md)",
    )
    load_format: Literal["auto", "dummy"] = Field(
        "auto", description="dummy: random weights (seeded by `seed`) with the named model's config, nothing read"
    )
    enforce_eager: bool = Field(
        False, description="decode steps without CUDA graphs (vLLM's name); graphs are never used on a CPU"
    )
    num_threads: int | None = Field(None, ge=1, le=MAX_NUM_THREADS)
    seed: int = Field(0, **SEED_RANGE)
    lora: LoraConfig | None = None

    @field_validator("max_num_batched_tokens", mode="before")
    @classmethod
    def _budget(cls, value):
        # One plain message instead of pydantic's error per member of the union.
        if isinstance(value, str) and value.strip().isdigit():
            value = int(value)
        if value is None or value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 16):
            return value
        raise ValueError("expected a whole number >= 16 or 'auto'")

    @model_validator(mode="after")
    def _apply_profile(self) -> EngineConfig:
        for key, value in PROFILES[self.profile].items():
            if getattr(self, key) is None:
                object.__setattr__(self, key, value)
        return self


class EmbedderConfig(BaseModel):
    """The Embedder's settings (engine/embedder.py)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    device: Literal["auto", "cpu", "cuda"] = "auto"
    ops_backend: Literal["auto", "torch", "triton"] = "auto"
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    max_num_batched_tokens: int = Field(
        8192, ge=16, description="tokens of one packed forward pass; a longer sequence runs alone"
    )
    num_threads: int | None = Field(None, ge=1, le=MAX_NUM_THREADS)
    # As sentence-transformers' encode(prompt=..., prompt_name=...): a text put before every text (an instruction,
    # for a query to Qwen3-Embedding), or one of the folder's named prompts; prompt wins, and with neither, the
    # folder's default_prompt_name if it has one.
    prompt: str | None = None
    prompt_name: str | None = None
