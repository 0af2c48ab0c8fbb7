"""LoRA adapters (PEFT folders: adapter_config.json + adapter_model.safetensors) applied beside the base model's
matmuls: each row of a step adds its adapter's low-rank update, x @ A^T @ B^T * scaling, to the base matmul's output,
which runs once for all rows (slots.py). The base weights are never changed.

Targets are the decoder's projections (q/k/v/o, gate/up/down, or Phi-3's fused qkv_proj/gate_up_proj); an update
of a projection that the model fuses with others (q, k and v in one qkv matmul) writes its slice of the output.
Anything else an adapter may hold (DoRA, biases, trained embeddings or heads, modules_to_save) is refused on load:
an adapter is untrusted input, and one applied in part would give wrong outputs without an error."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors

from batchjob.model.config import ModelConfig, weight_shapes
from batchjob.model.lora.files import WEIGHTS_FILE, LoraError, read_adapter

_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
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
    any tensor is parsed; the weights and the digest come from one read of the files."""
    cfg, data, digest = read_adapter(name, path)
    alpha = float(cfg["lora_alpha"])
    layers: list[dict[str, list]] = [{} for _ in range(config.num_hidden_layers)]
    rank = 0
    try:
        pairs = _checked_pairs(name, _header(data), config, max_rank)
        tensors = load_safetensors(data)
    except (SafetensorError, ValueError, RecursionError) as e:  # ValueError: a header that is not JSON
        raise LoraError(
            f"LoRA adapter {name!r}: {path / WEIGHTS_FILE} is not a readable safetensors file ({e})"
        ) from None
    for (layer, module), keys in sorted(pairs.items()):
        matmul, start, end = targets(config)[module]
        a, b = tensors[keys["A"]].float(), tensors[keys["B"]].float()
        r = a.shape[0]
        b = b * (alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r)
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):  # scaled: a huge alpha overflows
            raise LoraError(f"LoRA adapter {name!r}: layer {layer} {module}: NaN or infinite weights")
        if not (torch.isfinite(a.to(dtype)).all() and torch.isfinite(b.to(dtype)).all()):  # float16's 65504
            kind = str(dtype).removeprefix("torch.")
            raise LoraError(f"LoRA adapter {name!r}: layer {layer} {module}: weights beyond {kind}'s range")
        layers[layer].setdefault(matmul, []).append((start, end, a, b))
        rank = max(rank, r)
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
    return LoraAdapter(name, path, rank, digest, fused)


def _header(data: bytes) -> dict[str, dict]:
    """A safetensors file's tensors (name -> {"dtype", "shape", ...}) from its header, before any tensor is parsed;
    ValueError where the header is no safetensors header."""
    size = int.from_bytes(data[:8], "little")
    if len(data) < 8 or size > len(data) - 8:
        raise ValueError("the header's length runs past the file's end")
    header = json.loads(data[8 : 8 + size])
    if not isinstance(header, dict):
        raise ValueError("the header is no JSON object")
    header.pop("__metadata__", None)
    for key, entry in header.items():
        if not (
            isinstance(entry, dict) and isinstance(entry.get("dtype"), str) and isinstance(entry.get("shape"), list)
        ):
            raise ValueError(f"{key} has no dtype and shape")
    return header


def _checked_pairs(
    name: str, header: dict, config: ModelConfig, max_rank: int
) -> dict[tuple[int, str], dict[str, str]]:
    """The file's (layer, projection) -> {"A": key, "B": key}, every name, dtype and shape checked from its header
    against the base model's own modules (weight_shapes: the checkpoint's names, so that another family's fused or
    separate projections are refused even where their shapes would fit the fused matmul)."""
    pairs: dict[tuple[int, str, str], dict[str, str]] = {}  # by (layer, "self_attn" or "mlp", projection)
    for key, entry in header.items():
        m = _KEY.search(key)
        if m is None:
            raise LoraError(f"LoRA adapter {name!r}: {key} is not a LoRA weight of a decoder projection")
        if entry["dtype"] not in _FLOAT_DTYPES:
            raise LoraError(f"LoRA adapter {name!r}: {key} holds {entry['dtype']}, not floating-point weights")
        pair = pairs.setdefault((int(m[1]), m[2], m[3]), {})
        if m[4] in pair:  # another module's key ending alike (a vision tower's layers): one would be dropped
            raise LoraError(
                f"LoRA adapter {name!r}: two lora_{m[4]} weights for layer {m[1]} {m[3]}: {pair[m[4]]}, {key}"
            )
        pair[m[4]] = key
    if not pairs:
        raise LoraError(f"LoRA adapter {name!r}: {WEIGHTS_FILE} holds no LoRA weights")
    known, base = targets(config), weight_shapes(config)
    written: dict[tuple[int, str], list[tuple[int, int, str]]] = {}  # (layer, matmul) -> its targeted columns
    for (layer, block, module), keys in sorted(pairs.items()):
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
        prefix = f"model.layers.{layer}."
        weight = base.get(f"{prefix}{block}.{module}.weight")
        if weight is None:
            has = [m for m in known if f"{prefix}{block}.{m}.weight" in base]
            raise LoraError(
                f"LoRA adapter {name!r}: layer {layer} {block}.{module}: the base model has no such module "
                f"({config.architecture}'s {block} has {', '.join(has) or 'none that takes LoRA'}): "
                "an adapter of another model family?"
            )
        if set(keys) != {"A", "B"}:
            raise LoraError(f"{where}: lora_A and lora_B must both be present")
        a, b = tuple(header[keys["A"]]["shape"]), tuple(header[keys["B"]]["shape"])
        (out, fan_in), r = weight, a[0] if len(a) == 2 else -1
        if a != (r, fan_in) or b != (out, r):
            raise LoraError(
                f"{where}: lora_A {a} and lora_B {b} do not fit the base model (in {fan_in}, out {out}): "
                "an adapter of another model?"
            )
        if not 0 < r <= max_rank:
            raise LoraError(f"{where}: rank {r} is above max_lora_rank {max_rank}" if r else f"{where}: rank 0")
    return {(layer, module): keys for (layer, _, module), keys in pairs.items()}
