"""An embedding model as a sentence-transformers folder holds it: modules.json (Transformer, Pooling, optional
Normalize), the transformer's weights and config.json (a BERT encoder, or a Llama/Qwen2/Mistral decoder run through
decoder_embedding.py), the tokenizer, the length past which texts are cut, and config_sentence_transformers.json's
named prompts."""

from __future__ import annotations

import dataclasses
import glob
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer as HFTokenizer

from batchjob.model.backend import OpsBackend
from batchjob.model.bert import BertConfig, BertModel
from batchjob.model.config import ModelConfig
from batchjob.model.decoder_embedding import DecoderEmbeddingModel
from batchjob.model.errors import ModelLoadError, ModelNotFoundError
from batchjob.model.llama import LlamaModel
from batchjob.model.loader import check_weights, reading_model
from batchjob.model.packed import PackedBatch
from batchjob.model.pooling import Pooling

_MODULES = {"Transformer", "Pooling", "Normalize"}  # modules.json's types (by their last name) that are computed here
# tokenizer_config.json's model_max_length when the tokenizer has no limit of its own (transformers' VERY_LARGE_INTEGER)
_NO_LIMIT = int(1e30)


@dataclass(frozen=True)
class Tokenized:
    token_ids: list[int]
    truncated: bool  # the text had more tokens than max_seq_length; the ids are its first ones and the end token


@dataclass
class Encoder:
    model: BertModel | DecoderEmbeddingModel  # hidden states [T, hidden] of a PackedBatch, on the model's device
    tokenizer: HFTokenizer  # truncates to max_seq_length, special tokens included
    pooling: Pooling
    max_seq_length: int
    path: Path
    prompts: dict[str, str] = field(default_factory=dict)  # config_sentence_transformers.json's, by name
    default_prompt_name: str | None = None

    def tokenize(self, texts: list[str]) -> list[Tokenized]:
        return [Tokenized(e.ids, bool(e.overflowing)) for e in self.tokenizer.encode_batch(texts)]

    def prompt_length(self, prompt: str) -> int:
        """The tokens a prompt puts before a text, as sentence-transformers counts them: the prompt's own tokens and
        any special token ahead of them, not a special token the tokenizer ends every text with."""
        encoding = self.tokenizer.encode(prompt)
        return len(encoding.ids) - (1 if encoding.special_tokens_mask[-1:] == [1] else 0)

    def embed(self, batch: list[list[int]], prompt_lengths: list[int] | None = None) -> torch.Tensor:
        """The sentence embeddings [len(batch), hidden] (float32, on the host) of a batch of token-id lists, in one
        packed forward pass on the model's device: the inputs go there in one copy, the pooled embeddings come back
        in one read. `prompt_lengths`: how many of each list's first tokens are a prompt's (pooling leaves them out
        where its config says so)."""
        packed = PackedBatch.build(batch, self.model.device, prompt_lengths)
        return self.pooling(self.model(packed), packed.cu_seqlens, packed.prompt_lengths).cpu()


def load_encoder(
    path: Path, dtype: torch.dtype, ops: OpsBackend | None = None, device: torch.device | str = "cpu"
) -> Encoder:
    """A BERT encoder, or a decoder (its config.json's model_type not bert), on `device` with `ops` (the CPU's by
    default)."""
    if not (path / "modules.json").is_file():
        raise ModelNotFoundError(f"{path} is not a sentence-transformers folder: it has no modules.json")
    with reading_model(path):
        modules = json.loads((path / "modules.json").read_text())
        unknown = sorted({m["type"] for m in modules if m["type"].rsplit(".", 1)[-1] not in _MODULES})
        if unknown:
            raise ModelLoadError(f"its modules.json lists modules not supported here: {unknown}")
        pooling = Pooling.from_folder(path, modules)
        root = path / next(m["path"] for m in modules if m["type"].endswith(".Transformer"))
        hf_config = json.loads((root / "config.json").read_text())
        _check_text_modality(root)
        if ops is None:
            from batchjob.model import cpu_ops as ops
        if hf_config.get("model_type") == "bert":
            config = BertConfig.from_hf(hf_config)
            max_positions = config.max_position_embeddings
            model = BertModel(config, _weights(root, dtype), ops, device)
        else:
            model = _decoder(root, hf_config, dtype, ops, device)
            max_positions = model.config.max_position_embeddings
            if model.config.sliding_window:  # as the engine caps a context: the model attends no further
                max_positions = min(max_positions, model.config.sliding_window)
        max_len = min(_max_seq_length(root) or max_positions, max_positions)
        tokenizer = HFTokenizer.from_file(str(root / "tokenizer.json"))
        # tokenizer.json may carry its own truncation and padding; sentence-transformers cuts at max_seq_length
        tokenizer.enable_truncation(max_len)
        tokenizer.no_padding()
        st_config = path / "config_sentence_transformers.json"
        st = json.loads(st_config.read_text()) if st_config.is_file() else {}
    return Encoder(model, tokenizer, pooling, max_len, path, st.get("prompts") or {}, st.get("default_prompt_name"))


def _check_text_modality(root: Path) -> None:
    """sentence-transformers 6 renders every text through the tokenizer's chat template (as a user message) where
    the folder's modality_config lists "message" (saved from a model whose tokenizer has a chat template); texts here
    are tokenized as they are, so such a folder is refused rather than embedded otherwise."""
    st_config = root / "sentence_bert_config.json"
    modalities = json.loads(st_config.read_text()).get("modality_config", {}) if st_config.is_file() else {}
    if "message" in modalities:
        raise ModelLoadError(
            "its sentence_bert_config.json has the 'message' modality (texts rendered through the chat template), "
            "which is not supported here; remove it from modality_config to embed plain texts"
        )


def _max_seq_length(root: Path) -> int | None:
    """Where sentence-transformers keeps it: sentence_bert_config.json (before version 6), else the tokenizer's
    model_max_length."""
    st_config = root / "sentence_bert_config.json"
    if st_config.is_file() and (n := json.loads(st_config.read_text()).get("max_seq_length")):
        return n
    tok_config = root / "tokenizer_config.json"
    n = json.loads(tok_config.read_text()).get("model_max_length") if tok_config.is_file() else None
    return n if n and n < _NO_LIMIT else None


def _weights(root: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The transformer's weights in `dtype` (integer tensors as they are): safetensors, sharded or not, or
    pytorch_model.bin."""
    index = root / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({root / f for f in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = sorted(Path(p) for p in glob.glob(str(root / "*.safetensors")))
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update(load_file(str(f)))
    if not files and (root / "pytorch_model.bin").is_file():
        weights = torch.load(root / "pytorch_model.bin", map_location="cpu", weights_only=True)
    elif not files:
        raise ModelLoadError("the folder has neither *.safetensors nor pytorch_model.bin")
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in weights.items()}


def _decoder(
    root: Path, hf_config: dict, dtype: torch.dtype, ops: OpsBackend, device: torch.device | str
) -> DecoderEmbeddingModel:
    """sentence-transformers saves the bare transformer (Qwen2Model: no LM head, tensor names without `model.`);
    a folder may also hold the whole *ForCausalLM. Either runs as its *ForCausalLM without the head."""
    arch = (hf_config.get("architectures") or ["?"])[0]
    if arch.endswith("Model"):
        arch = arch.removesuffix("Model") + "ForCausalLM"
    try:
        config = ModelConfig.from_hf({**hf_config, "architectures": [arch]})
    except (ValueError, KeyError) as e:
        raise ModelLoadError(f"its config.json cannot be used: {e}") from None
    weights = {
        k if k.startswith("model.") else f"model.{k}": v
        for k, v in _weights(root, dtype).items()
        if k != "lm_head.weight"
    }
    # no head is built: checked as if tied, the weights need none
    check_weights(dataclasses.replace(config, tie_word_embeddings=True), weights)
    return DecoderEmbeddingModel(LlamaModel(config, weights, ops, device=device, lm_head=False))
