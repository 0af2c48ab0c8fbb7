"""An encoder as a sentence-transformers folder holds it: modules.json (Transformer, Pooling, optional Normalize),
the BERT weights and config.json, the tokenizer, and sentence_bert_config.json's max_seq_length, the length past
which texts are cut."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer as HFTokenizer

from batchjob.model.bert import BertConfig, BertModel
from batchjob.model.errors import ModelLoadError, ModelNotFoundError
from batchjob.model.loader import reading_model
from batchjob.model.pooling import Pooling

_MODULES = {"Transformer", "Pooling", "Normalize"}  # modules.json's types (by their last name) that are computed here


@dataclass(frozen=True)
class Tokenized:
    token_ids: list[int]
    truncated: bool  # the text had more tokens than max_seq_length; the ids are its first ones and the end token


@dataclass
class Encoder:
    model: BertModel
    tokenizer: HFTokenizer  # truncates to max_seq_length, special tokens included
    pooling: Pooling
    max_seq_length: int
    path: Path

    def tokenize(self, texts: list[str]) -> list[Tokenized]:
        return [Tokenized(e.ids, bool(e.overflowing)) for e in self.tokenizer.encode_batch(texts)]

    def embed(self, batch: list[list[int]]) -> torch.Tensor:
        """The sentence embeddings [len(batch), hidden] (float32) of a batch of token-id lists, in one packed
        forward pass."""
        cu_seqlens = [0]
        for ids in batch:
            cu_seqlens.append(cu_seqlens[-1] + len(ids))
        input_ids = torch.tensor([t for ids in batch for t in ids])
        return self.pooling(self.model(input_ids, cu_seqlens), cu_seqlens)


def load_encoder(path: Path, dtype: torch.dtype) -> Encoder:
    if not (path / "modules.json").is_file():
        raise ModelNotFoundError(f"{path} is not a sentence-transformers folder: it has no modules.json")
    with reading_model(path):
        modules = json.loads((path / "modules.json").read_text())
        unknown = sorted({m["type"] for m in modules if m["type"].rsplit(".", 1)[-1] not in _MODULES})
        if unknown:
            raise ModelLoadError(f"its modules.json lists modules not supported here: {unknown}")
        pooling = Pooling.from_folder(path, modules)
        root = path / next(m["path"] for m in modules if m["type"].endswith(".Transformer"))
        config = BertConfig.from_hf(json.loads((root / "config.json").read_text()))
        st_config = root / "sentence_bert_config.json"
        max_len = json.loads(st_config.read_text()).get("max_seq_length") if st_config.is_file() else None
        max_len = min(max_len or config.max_position_embeddings, config.max_position_embeddings)
        tokenizer = HFTokenizer.from_file(str(root / "tokenizer.json"))
        # tokenizer.json may carry its own truncation and padding; sentence-transformers cuts at max_seq_length
        tokenizer.enable_truncation(max_len)
        tokenizer.no_padding()
        if (root / "model.safetensors").is_file():
            weights = load_file(str(root / "model.safetensors"))
        elif (root / "pytorch_model.bin").is_file():
            weights = torch.load(root / "pytorch_model.bin", map_location="cpu", weights_only=True)
        else:
            raise ModelLoadError("the folder has neither model.safetensors nor pytorch_model.bin")
        model = BertModel(config, {k: v.to(dtype) if v.is_floating_point() else v for k, v in weights.items()})
    return Encoder(model, tokenizer, pooling, max_len, path)
