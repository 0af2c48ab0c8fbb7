"""A loaded model written back out as a Hugging Face folder (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json), for peers that read only such folders (vLLM, transformers) to run the very same weights."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import save_file

from batchjob.model.config import GEMMA_ARCHITECTURES, ModelConfig
from batchjob.model.loader import LoadedModel, cache_dir, load_model
from batchjob.model.tokenizer import Tokenizer

SHARD_BYTES = 2 << 30  # transformers' default max_shard_size is 5 GB; smaller keeps the writer's peak low

_MODEL_TYPES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "MistralForCausalLM": "mistral"}
_MODEL_TYPES |= {"Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe", "MixtralForCausalLM": "mixtral"}
_MODEL_TYPES |= {"Phi3ForCausalLM": "phi3"}
_MODEL_TYPES |= {"Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3_text"}


def hf_config(c: ModelConfig, dtype: torch.dtype = torch.float32) -> dict:
    """config.json as transformers writes it for the architecture, its weights stored in `dtype`."""
    moe = {}
    if c.architecture == "Qwen3MoeForCausalLM":
        moe = {
            "num_experts": c.num_experts,
            "num_experts_per_tok": c.num_experts_per_tok,
            "moe_intermediate_size": c.moe_intermediate_size,
            "norm_topk_prob": c.norm_topk_prob,
            "decoder_sparse_step": c.decoder_sparse_step,
            "mlp_only_layers": list(c.mlp_only_layers),
        }
    elif c.architecture == "MixtralForCausalLM":
        moe = {"num_local_experts": c.num_experts, "num_experts_per_tok": c.num_experts_per_tok}
    rope = c.rope_scaling if (c.rope_scaling or {}).get("rope_type") == "longrope" else None
    return (
        moe
        | {
            "architectures": [c.architecture],
            "model_type": _MODEL_TYPES[c.architecture],
            "vocab_size": c.vocab_size,
            "hidden_size": c.hidden_size,
            "intermediate_size": c.intermediate_size,
            "num_hidden_layers": c.num_hidden_layers,
            "num_attention_heads": c.num_attention_heads,
            "num_key_value_heads": c.num_key_value_heads,
            "head_dim": c.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": c.rms_norm_eps,
            "rope_theta": c.rope_theta,
            "rope_scaling": c.rope_scaling,
            "max_position_embeddings": c.max_position_embeddings,
            "tie_word_embeddings": c.tie_word_embeddings,
            "attention_bias": c.attention_bias,
            "sliding_window": c.sliding_window,
            "bos_token_id": c.bos_token_id,
            "eos_token_id": list(c.eos_token_ids) if len(c.eos_token_ids) != 1 else c.eos_token_ids[0],
            "torch_dtype": str(dtype).removeprefix("torch."),
            # none: Phi3Config's default (32000) need not lie in the vocabulary, and inference pads nothing
            "pad_token_id": None,
            "partial_rotary_factor": c.partial_rotary_factor,
            # Phi-3's transformers config reads the pretraining length here (not from rope_scaling), 4096 when absent
            **({"original_max_position_embeddings": rope["original_max_position_embeddings"]} if rope else {}),
        }
        | (_gemma_config(c) if c.architecture in GEMMA_ARCHITECTURES else {})
    )


def _gemma_config(c: ModelConfig) -> dict:
    """Gemma's keys as transformers reads them (older configs' rope_local_base_freq included)."""
    extra = {
        "hidden_activation": "gelu_pytorch_tanh",
        "layer_types": list(c.layer_types),
        "query_pre_attn_scalar": c.query_pre_attn_scalar,
        "attn_logit_softcapping": c.attn_logit_softcapping,
        "final_logit_softcapping": c.final_logit_softcapping,
    }
    if c.rope_local_base_freq is not None:
        extra["rope_local_base_freq"] = c.rope_local_base_freq
    return extra


def export_hf(loaded: LoadedModel, folder: Path) -> Path:
    """Writes `loaded` as an HF folder in float32 (atomically: a reader never sees half of it) and returns it."""
    if loaded.rope_freqs is not None:
        raise ValueError("a GGUF with rope_freqs (llama3 scaling baked into a tensor) has no plain HF form here")
    tensors = ((k, v.float()) for k, v in loaded.weights.items())
    return write_hf_folder(loaded.config, loaded.tokenizer, tensors, folder, torch.float32)


def write_hf_folder(
    config: ModelConfig, tokenizer: Tokenizer, tensors: Iterable[tuple[str, torch.Tensor]], folder: Path, dtype
) -> Path:
    """An HF folder of `tensors` (each in `dtype`) consumed one at a time: they go to disk in shards of about
    SHARD_BYTES with an index, as transformers shards, so an 8B model is written holding one shard, not the model.
    One shard is the single model.safetensors transformers writes for a small model."""
    tmp = folder.with_name(f"{folder.name}.{os.getpid()}.part")
    tmp.mkdir(parents=True, exist_ok=True)
    written: list[list[str]] = []  # each shard's tensor names, in order
    shard: dict[str, torch.Tensor] = {}
    size = 0

    def flush() -> None:
        save_file(shard, str(tmp / f"part-{len(written)}.safetensors"), metadata={"format": "pt"})
        written.append(list(shard))

    for name, t in tensors:
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # shared with the embedding; safetensors refuses aliases
        if size >= SHARD_BYTES:  # this shard goes to disk and its tensors are freed
            flush()
            shard, size = {}, 0
        shard[name] = t.to(dtype).contiguous()
        size += shard[name].nbytes
    flush()
    if len(written) == 1:
        (tmp / "part-0.safetensors").rename(tmp / "model.safetensors")
    else:
        weight_map = {}
        for i, names in enumerate(written):
            final = f"model-{i + 1:05d}-of-{len(written):05d}.safetensors"
            (tmp / f"part-{i}.safetensors").rename(tmp / final)
            weight_map |= dict.fromkeys(names, final)
        index = {"metadata": {}, "weight_map": weight_map}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    (tmp / "config.json").write_text(json.dumps(hf_config(config, dtype), indent=1))
    tokenizer.save(tmp)
    if folder.exists():  # another process exported it meanwhile
        shutil.rmtree(tmp)
    else:
        os.replace(tmp, folder)
    return folder


def hf_folder(model: str) -> Path:
    """`model` (a name, GGUF file or HF folder) as an HF folder: an HF folder is itself; anything else is exported
    once into the cache by the digest of its weights."""
    loaded = load_model(model)
    if loaded.path.is_dir():
        return loaded.path
    folder = cache_dir() / "hf" / loaded.digest
    return folder if (folder / "config.json").exists() else export_hf(loaded, folder)
