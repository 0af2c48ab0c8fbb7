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
from batchjob.model.lora.slots import LoraBatch, LoraSlots
from batchjob.model.lora.weights import load_lora


class LoraManager:
    def __init__(self, config: LoraConfig, model: ModelConfig, device: torch.device, dtype: torch.dtype):
        self.config, self.model, self.device, self.dtype = config, model, device, dtype
        self.paths = adapter_paths(config.adapters)
        self.digests: dict[str, str] = {}

        def checked():  # one at a time: a slot is filled from the files on first use
            for name, path in self.paths.items():
                adapter = load_lora(name, path, model, config.max_lora_rank, dtype)
                self.digests[name] = adapter.digest
                yield adapter

        self.stacked = LoraSlots(checked(), min(config.max_loras, len(self.paths)), device, dtype)
        self.slots: OrderedDict[str, int] = OrderedDict()  # adapter name -> its slot, least recently used first
        self.loads = 0  # adapters read into a slot, first uses and reloads after eviction

    def slot(self, name: str) -> int:
        """The adapter's slot, read into one (taking the least recently used's) if it holds none."""
        if name in self.slots:
            self.slots.move_to_end(name)
            return self.slots[name]
        adapter = load_lora(name, self.paths[name], self.model, self.config.max_lora_rank, self.dtype)
        if adapter.digest != self.digests[name]:  # the folder changed since the engine checked it
            raise LoraError(f"LoRA adapter {name!r}: {self.paths[name]} changed while the engine ran")
        free = len(self.slots) < self.stacked.num_slots
        slot = len(self.slots) if free else self.slots.popitem(last=False)[1]
        self.stacked.load(slot, adapter)
        self.slots[name] = slot
        self.loads += 1
        return slot

    def batch(self, scheduled: list[tuple[str | None, int]]) -> LoraBatch | None:
        """The step's LoraBatch from each scheduled sequence's adapter name (None: the base model) and token count."""
        if all(name is None for name, _ in scheduled):
            return None
        rows = [(None if name is None else self.slot(name), n) for name, n in scheduled]
        return LoraBatch.build(self.stacked, rows, self.device)
