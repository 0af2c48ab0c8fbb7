"""The engine's LoRA adapters: every one named in the config is read and checked when the engine starts (a damaged or
mismatched adapter refuses it before any row runs), then held on the device in at most `max_loras` slots, loaded on
first use and the least recently used dropped. The scheduler admits the rows of at most `max_loras` adapters at once,
so every adapter of a step has its slot."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import torch

from batchjob.engine.config import LoraConfig
from batchjob.model.config import ModelConfig
from batchjob.model.lora import (
    LoraAdapter,
    LoraBatch,
    LoraError,
    adapter_digest,
    load_lora,
    read_adapter_config,
    weights_file,
)


def adapter_paths(config: LoraConfig) -> dict[str, Path]:
    """Each adapter's folder; LoraError naming the adapter where there is no such folder."""
    paths = {name: Path(path).expanduser() for name, path in config.adapters.items()}
    for name, path in paths.items():
        if not path.is_dir():
            raise LoraError(f"LoRA adapter {name!r}: {path} is not a folder (a PEFT adapter's)")
    return paths


def adapter_digests(config: LoraConfig) -> dict[str, str]:
    """Each adapter's content digest by name, read without loading it (a job's fingerprint holds them); LoraError
    where an adapter's folder or files are missing."""
    digests = {}
    for name, path in adapter_paths(config).items():
        read_adapter_config(name, path)
        weights_file(name, path)
        try:
            digests[name] = adapter_digest(path)
        except OSError as e:
            raise LoraError(f"LoRA adapter {name!r}: cannot read its files ({e})") from None
    return digests


class LoraManager:
    def __init__(self, config: LoraConfig, model: ModelConfig, device: torch.device, dtype: torch.dtype):
        self.config, self.model, self.device, self.dtype = config, model, device, dtype
        self.paths = adapter_paths(config)
        self.digests = {
            name: load_lora(name, path, model, config.max_lora_rank).digest for name, path in self.paths.items()
        }
        self.slots: OrderedDict[str, LoraAdapter] = OrderedDict()
        self.loads = 0  # adapters read into a slot, first uses and reloads after eviction

    def adapter(self, name: str) -> LoraAdapter:
        """The adapter in its slot, read into one (dropping the least recently used) if it holds none."""
        if name in self.slots:
            self.slots.move_to_end(name)
            return self.slots[name]
        adapter = load_lora(name, self.paths[name], self.model, self.config.max_lora_rank)
        if adapter.digest != self.digests[name]:  # the folder changed since the engine checked it
            raise LoraError(f"LoRA adapter {name!r}: {self.paths[name]} changed while the engine ran")
        while len(self.slots) >= self.config.max_loras:
            self.slots.popitem(last=False)
        self.slots[name] = adapter.to(self.device, self.dtype)
        self.loads += 1
        return self.slots[name]

    def batch(self, scheduled: list[tuple[str | None, int]]) -> LoraBatch | None:
        """The step's LoraBatch from each scheduled sequence's adapter name (None: the base model) and token count."""
        if all(name is None for name, _ in scheduled):
            return None
        return LoraBatch.build(((None if n is None else self.adapter(n), k) for n, k in scheduled), self.device)
