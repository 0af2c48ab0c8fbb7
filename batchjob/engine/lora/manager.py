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
        # Adapters whose folder changed after the engine read it, with the reason: their requests fail from then on
        # (the digest that keys their results is the first files'), the other adapters' go on.
        self.changed: dict[str, str] = {}

    def load(self, names: set[str]) -> dict[str, str]:
        """Each of `names` (a step's adapters, at most the slots) in a slot; those whose folder changed since the
        engine read it stay out, returned with the reason."""
        failed = {}
        for name in sorted(names, key=lambda n: n not in self.slots):  # held ones first: a load must not evict them
            try:
                self.slot(name)
            except LoraError as e:
                failed[name] = str(e)
        return failed

    def slot(self, name: str) -> int:
        """The adapter's slot, read into one (taking the least recently used's) if it holds none; LoraError where
        its folder changed since the engine read it."""
        if name in self.slots:
            self.slots.move_to_end(name)
            return self.slots[name]
        if name in self.changed:
            raise LoraError(self.changed[name])
        try:
            adapter = load_lora(name, self.paths[name], self.model, self.config.max_lora_rank, self.dtype)
            why = None if adapter.digest == self.digests[name] else "other content"
        except LoraError as e:  # deleted or damaged since
            why = str(e).removeprefix(f"LoRA adapter {name!r}: ")
        if why is not None:
            self.changed[name] = (
                f"LoRA adapter {name!r}: its files in {self.paths[name]} changed during the run ({why}); its "
                "remaining rows fail, as the run's results are keyed by the files it started with"
            )
            raise LoraError(self.changed[name])
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
