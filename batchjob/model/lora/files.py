"""A LoRA adapter's files (a PEFT folder: adapter_config.json + adapter_model.safetensors), read without torch: the
config checked to be a plain LoRA, and the files' content digest, which a job's fingerprint holds before any model
loads. weights.py reads the weights."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

from batchjob.model.errors import ModelError

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
# Settings that change what an adapter computes beyond x @ A^T @ B^T * scaling: refused unless at these values.
_PLAIN = {"use_dora": False, "bias": "none", "modules_to_save": None, "fan_in_fan_out": False, "lora_bias": False}
_PLAIN |= {"alpha_pattern": {}, "layer_replication": None, "use_qalora": False}


class LoraError(ModelError):
    """An adapter that cannot be applied to this model, with the reason (naming the adapter)."""


def read_adapter(name: str, path: Path) -> tuple[dict, bytes, str]:
    """The folder's adapter_config.json (checked to be a plain LoRA), its weights file's bytes and the content digest
    of the very bytes read: each file is read once, so that a file replaced meanwhile cannot pair one version's
    weights with another's digest. LoraError naming the adapter where a file is missing, unreadable or not plain."""
    file = path / CONFIG_FILE
    if not file.is_file():
        raise LoraError(f"LoRA adapter {name!r}: no {CONFIG_FILE} in {path}")
    try:
        config = file.read_bytes()
        cfg = _plain_config(name, file, config)
        data = weights_file(name, path).read_bytes()
    except OSError as e:
        raise LoraError(f"LoRA adapter {name!r}: cannot read its files ({e})") from None
    return cfg, data, _digest(config, data)


def _plain_config(name: str, file: Path, data: bytes) -> dict:
    try:
        cfg = json.loads(data)
    except (ValueError, RecursionError) as e:  # ValueError: bad JSON, bad UTF-8, an endless number
        raise LoraError(f"LoRA adapter {name!r}: {file} is not readable JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise LoraError(f"LoRA adapter {name!r}: {file} holds no JSON object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoraError(f"LoRA adapter {name!r}: peft_type {cfg.get('peft_type')!r}; only LORA is applied")
    for key, plain in _PLAIN.items():
        value = cfg.get(key, plain)
        empty = plain in (None, {}) and value in (None, [], {})  # PEFT writes either for "none"
        if value != plain and not empty:
            raise LoraError(f"LoRA adapter {name!r}: {key} = {value!r} is not supported (only plain LoRA is)")
    alpha = cfg.get("lora_alpha")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise LoraError(f"LoRA adapter {name!r}: lora_alpha {alpha!r} is not a number")
    return cfg


def weights_file(name: str, path: Path) -> Path:
    """The folder's adapter_model.safetensors; LoraError where it has none."""
    file = path / WEIGHTS_FILE
    if not file.is_file():
        pickled = (path / "adapter_model.bin").is_file()
        why = " (adapter_model.bin, a pickle, is not read: save with safetensors)" if pickled else ""
        raise LoraError(f"LoRA adapter {name!r}: no {WEIGHTS_FILE} in {path}{why}")
    return file


def adapter_paths(adapters: dict[str, str]) -> dict[str, Path]:
    """Each adapter's folder, by name; LoraError naming the adapter where there is no such folder."""
    paths = {name: Path(path).expanduser() for name, path in adapters.items()}
    for name, path in paths.items():
        if not path.is_dir():
            raise LoraError(f"LoRA adapter {name!r}: {path} is not a folder (a PEFT adapter's)")
    return paths


def adapter_digests(adapters: dict[str, str]) -> dict[str, str]:
    """Each adapter's content digest by name, its config checked but its weights not parsed; LoraError where an
    adapter's folder or files are missing or its config is not a plain LoRA's."""
    return {name: read_adapter(name, path)[2] for name, path in adapter_paths(adapters).items()}


def _digest(config: bytes, weights: bytes) -> str:
    """sha256 of the adapter's two files (config, then weights): the results cache and output fingerprint key by it."""
    h = hashlib.sha256()
    for data in (config, weights):
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()
