"""A decoder (Llama, Qwen2, Mistral) as a sentence encoder, as Qwen3-Embedding and gte-Qwen2 use one: the last
hidden states of packed sequences from one prefill-only forward pass of LlamaModel, each sequence attending causally
to itself alone through the ops backend's paged attention (the C++ kernel on a CPU, Triton on a GPU); no padding.

No sequence outlives its pass, and within a pass a layer reads only the keys and values it has just written, so one
layer's worth of KV blocks serves every layer in turn (the next overwrites it): the scratch cache is the size of one
layer's K/V for one pass, and grows to the largest pass seen."""

from __future__ import annotations

import torch

from batchjob.model.attention_metadata import AttentionMetadata
from batchjob.model.config import ModelConfig
from batchjob.model.llama import LlamaModel
from batchjob.model.packed import PackedBatch

BLOCK_SIZE = 16  # the engine's default block size, which every attention backend takes


class DecoderEmbeddingModel:
    def __init__(self, model: LlamaModel, block_size: int = BLOCK_SIZE):
        self.model, self.block_size = model, block_size
        self._cache: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def config(self) -> ModelConfig:
        return self.model.config

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed.device

    @torch.inference_mode()
    def __call__(self, batch: PackedBatch) -> torch.Tensor:
        """The last (final-normed) hidden states [T, hidden] of the packed batch (on the model's device). Sequence
        i's K/V go to blocks of its own, so that each starts a block as the paged kernels read it."""
        bs = self.block_size
        lens = batch.seq_lens
        lengths = torch.tensor(lens)
        starts = torch.cumsum(lengths, 0) - lengths
        blocks = -(-lengths // bs)
        first_block = torch.cumsum(blocks, 0) - blocks
        columns = torch.arange(int(blocks.max()))
        tables = torch.where(columns < blocks[:, None], first_block[:, None] + columns, -1)
        # the block tables and slots are built on the host, as AttentionMetadata takes them
        positions = torch.arange(sum(lens)) - torch.repeat_interleave(starts, lengths)
        slots = torch.repeat_interleave(first_block * bs, lengths) + positions
        meta = AttentionMetadata.build(lens, lens, tables, slots, self.device)
        cache = self._scratch(int(blocks.sum()))
        caches = [cache] * self.config.num_hidden_layers
        return self.model.forward(batch.input_ids, batch.positions, meta, caches)

    def _scratch(self, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._cache is None or self._cache[0].shape[0] < num_blocks:
            self._cache = None  # the old one freed before the larger one is allocated
            c = self.config
            shape = (num_blocks, self.block_size, c.num_key_value_heads, c.head_dim)
            # zeros, not empty: a kernel may read a block's unused slots (masked), and NaN garbage times 0 is NaN
            self._cache = tuple(torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(2))
        return self._cache
