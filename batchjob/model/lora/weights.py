"""LoRA adapters (PEFT folders: adapter_config.json + adapter_model.safetensors) applied beside the base model's
matmuls: each row of a step adds its adapter's low-rank update, x @ A^T @ B^T * scaling, to the base matmul's output,
which runs once for all rows (slots.py). The base weights are never changed.

Targets are the decoder's projections (q/k/v/o, gate/up/down, or Phi-3's fused qkv_proj/gate_up_proj); an update
of a projection that the model fuses with others (q, k and v in one qkv matmul) writes its slice of the output.
Anything else an adapter may hold (DoRA, biases, trained embeddings or heads, modules_to_save) is refused on load:
an adapter is untrusted input, and one applied in part would give wrong outputs without an error."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from batchjob.model.config import ModelConfig
from batchjob.model.lora.files import (
    WEIGHTS_FILE,
    LoraError,
    adapter_digest,
    read_adapter_config,
    weights_file,
)

_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
_FLOAT_DTYPES = {"F16", "BF16", "F32", "F64"}


def targets(c: ModelConfig) -> dict[str, tuple[str, int, int]]:
    """Each projection an adapter may target: (the model's fused matmul, first output column, last + 1)."""
    q, kv, inter = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim, c.intermediate_size
    return {
        "q_proj": ("qkv", 0, q),
        "k_proj": ("qkv", q, q + kv),
        "v_proj": ("qkv", q + kv, q + 2 * kv),
        "qkv_proj": ("qkv", 0, q + 2 * kv),
        "o_proj": ("o", 0, c.hidden_size),
        "gate_proj": ("gate_up", 0, inter),
        "up_proj": ("gate_up", inter, 2 * inter),
        "gate_up_proj": ("gate_up", 0, 2 * inter),
        "down_proj": ("down", 0, c.hidden_size),
    }


def in_features(c: ModelConfig, matmul: str) -> int:
    """The input width of one of the model's fused matmuls ("qkv", "o", "gate_up", "down")."""
    return {"qkv": c.hidden_size, "o": c.num_attention_heads * c.head_dim, "gate_up": c.hidden_size}.get(
        matmul, c.intermediate_size
    )


def _out_features(c: ModelConfig, matmul: str) -> int:
    return max(end for name, (m, _, end) in targets(c).items() if m == matmul)


@dataclass
class LoraUpdate:
    """One fused matmul's update: the targeted projections' A stacked ([sum of ranks, in]: one shrink), and their B
    with the scaling folded in, laid block-diagonally over the matmul's output columns ([out, sum of ranks]: one
    expand; zeros where a projection is not targeted)."""

    a: torch.Tensor
    b: torch.Tensor


@dataclass
class LoraAdapter:
    name: str
    path: Path
    rank: int  # the largest of its projections'
    digest: str  # of its config and weights' bytes: what caches key the adapter's results by
    layers: list[dict[str, LoraUpdate]]  # per decoder layer, by fused matmul name ("qkv", "o", "gate_up", "down")


def load_lora(name: str, path: Path, config: ModelConfig, max_rank: int, dtype: torch.dtype) -> LoraAdapter:
    """The adapter at `path` (a PEFT folder) for a model of `config`, in float32 on the host; LoraError naming the
    adapter and the reason when it is not a plain LoRA of this model's projections, a rank above `max_rank`, or
    weights that `dtype` (the slots') cannot hold. Names, dtypes and shapes are checked from the file's header before
    any tensor is read."""
    cfg = read_adapter_config(name, path)
    file = weights_file(name, path)
    alpha = float(cfg["lora_alpha"])
    layers: list[dict[str, list]] = [{} for _ in range(config.num_hidden_layers)]
    rank = 0
    try:
        with safe_open(str(file), "pt") as f:
            pairs = _checked_pairs(name, f, config, max_rank)
            for (layer, module), keys in sorted(pairs.items()):
                matmul, start, end = targets(config)[module]
                a, b = f.get_tensor(keys["A"]).float(), f.get_tensor(keys["B"]).float()
                r = a.shape[0]
                b = b * (alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r)
                if not (torch.isfinite(a).all() and torch.isfinite(b).all()):  # scaled: a huge alpha overflows
                    raise LoraError(f"LoRA adapter {name!r}: layer {layer} {module}: NaN or infinite weights")
                if not (torch.isfinite(a.to(dtype)).all() and torch.isfinite(b.to(dtype)).all()):  # float16's 65504
                    kind = str(dtype).removeprefix("torch.")
                    raise LoraError(f"LoRA adapter {name!r}: layer {layer} {module}: weights beyond {kind}'s range")
                layers[layer].setdefault(matmul, []).append((start, end, a, b))
                rank = max(rank, r)
    except (SafetensorError, OSError, ValueError) as e:
        raise LoraError(f"LoRA adapter {name!r}: {file} is not a readable safetensors file ({e})") from None
    fused = []
    for layer in layers:
        updates = {}
        for matmul, parts in layer.items():
            stacked = torch.cat([a for _, _, a, _ in parts])
            expand = torch.zeros(_out_features(config, matmul), stacked.shape[0])
            r0 = 0
            for start, end, a, b in parts:
                expand[start:end, r0 : r0 + a.shape[0]] = b
                r0 += a.shape[0]
            updates[matmul] = LoraUpdate(stacked, expand)
        fused.append(updates)
    return LoraAdapter(name, path, rank, adapter_digest(path), fused)


def _checked_pairs(name: str, f, config: ModelConfig, max_rank: int) -> dict[tuple[int, str], dict[str, str]]:
    """The file's (layer, projection) -> {"A": key, "B": key}, every name, dtype and shape checked from its header."""
    pairs: dict[tuple[int, str], dict[str, str]] = {}
    shapes = {}
    for key in f.keys():  # noqa: SIM118 (safe_open has no iteration)
        m = _KEY.search(key)
        if m is None:
            raise LoraError(f"LoRA adapter {name!r}: {key} is not a LoRA weight of a decoder projection")
        part = f.get_slice(key)
        if part.get_dtype() not in _FLOAT_DTYPES:
            raise LoraError(f"LoRA adapter {name!r}: {key} holds {part.get_dtype()}, not floating-point weights")
        pair = pairs.setdefault((int(m[1]), m[2]), {})
        if m[3] in pair:  # another module's key ending alike (a vision tower's layers): one would be dropped
            raise LoraError(
                f"LoRA adapter {name!r}: two lora_{m[3]} weights for layer {m[1]} {m[2]}: {pair[m[3]]}, {key}"
            )
        pair[m[3]] = key
        shapes[key] = tuple(part.get_shape())
    if not pairs:
        raise LoraError(f"LoRA adapter {name!r}: {WEIGHTS_FILE} holds no LoRA weights")
    known = targets(config)
    written: dict[tuple[int, str], list[tuple[int, int, str]]] = {}  # (layer, matmul) -> its targeted columns
    for (layer, module), keys in sorted(pairs.items()):
        where = f"LoRA adapter {name!r}: layer {layer} {module}"
        if module not in known:
            raise LoraError(f"{where}: not a projection LoRA is applied to here ({', '.join(known)})")
        matmul, start, end = known[module]
        # a projection and the fused one holding it (q_proj and qkv_proj): no model has both, and both would add
        for s, e, other in written.setdefault((layer, matmul), []):
            if s < end and start < e:
                raise LoraError(f"LoRA adapter {name!r}: layer {layer}: {other} and {module} update the same outputs")
        written[(layer, matmul)].append((start, end, module))
        if not 0 <= layer < config.num_hidden_layers:
            raise LoraError(f"{where}: the model has {config.num_hidden_layers} layers")
        if config.is_moe_layer(layer) and matmul in ("gate_up", "down"):
            raise LoraError(f"{where}: a sparse MoE layer's experts take no LoRA here")
        if set(keys) != {"A", "B"}:
            raise LoraError(f"{where}: lora_A and lora_B must both be present")
        a, b = shapes[keys["A"]], shapes[keys["B"]]
        r, fan_in = a[0] if len(a) == 2 else -1, in_features(config, matmul)
        if a != (r, fan_in) or b != (end - start, r):
            raise LoraError(
                f"{where}: lora_A {a} and lora_B {b} do not fit the base model (in {fan_in}, out {end - start}): "
                "an adapter of another model?"
            )
        if not 0 < r <= max_rank:
            raise LoraError(f"{where}: rank {r} is above max_lora_rank {max_rank}" if r else f"{where}: rank 0")
    return pairs
