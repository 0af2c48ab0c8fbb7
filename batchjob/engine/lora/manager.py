"""The engine's LoRA adapters: every one named in the config is read and checked when the engine starts (a damaged or
mismatched adapter refuses it before any row runs), then held on the device in at most `max_loras` slots, loaded on
first use and the least recently used dropped. The scheduler admits the rows of at most `max_loras` adapters at once,
so every adapter of a step has its slot."""

from __future__ import annotations

from collections import OrderedDict

import torch

from batchjob.engine.config import LoraConfig
from batchjob.model.config import ModelConfig
from batchjob.model.lora.files import LoraError, adapter_paths
from batchjob.model.lora.weights import LoraAdapter, LoraBatch, load_lora


class LoraManager:
    def __init__(self, config: LoraConfig, model: ModelConfig, device: torch.device, dtype: torch.dtype):
        self.config, self.model, self.device, self.dtype = config, model, device, dtype
        self.paths = adapter_paths(config.adapters)
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
