"""A BERT encoder (transformers' BertModel weights: absolute positions, post-LayerNorm, GELU MLP) run on packed rows.

A batch of sequences is one [T, hidden] tensor of their tokens laid end to end, no padding: every matmul and
elementwise op runs on all T rows at once, and only attention looks at the sequences one by one (`cu_seqlens`, the
row where each starts, and the end)."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import torch
import torch.nn.functional as F

from batchjob.model.errors import ModelLoadError
from batchjob.model.linear import Linear

# transformers' names of the activations (ACT2FN): "gelu" is the exact erf form, the others its tanh approximation.
_GELU_APPROXIMATION = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    hidden_act: str

    @classmethod
    def from_hf(cls, cfg: dict) -> BertConfig:
        if cfg.get("model_type") != "bert":
            raise ModelLoadError(f"its config.json has model_type {cfg.get('model_type')!r}; encoders here are bert")
        if cfg.get("position_embedding_type", "absolute") != "absolute":
            raise ModelLoadError(f"position_embedding_type {cfg['position_embedding_type']!r} is not supported")
        if cfg.get("hidden_act", "gelu") not in _GELU_APPROXIMATION:
            raise ModelLoadError(f"hidden_act {cfg['hidden_act']!r} is not supported ({sorted(_GELU_APPROXIMATION)})")
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=cfg["num_attention_heads"],
            intermediate_size=cfg["intermediate_size"],
            max_position_embeddings=cfg["max_position_embeddings"],
            type_vocab_size=cfg.get("type_vocab_size", 2),
            layer_norm_eps=cfg.get("layer_norm_eps", 1e-12),
            hidden_act=cfg.get("hidden_act", "gelu"),
        )


@dataclass(frozen=True)
class _LayerNorm:
    weight: torch.Tensor
    bias: torch.Tensor
    eps: float

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


@dataclass(frozen=True)
class _Layer:
    qkv: Linear  # query, key and value in one matmul
    attention_out: Linear
    attention_norm: _LayerNorm
    up: Linear
    down: Linear
    output_norm: _LayerNorm


class BertModel:
    def __init__(self, config: BertConfig, weights: dict[str, torch.Tensor]):
        """`weights` by transformers' BertModel names (a leading `bert.`, as BertFor* heads save them, is dropped),
        already in the dtype to compute in."""
        self.config = config
        w = {k.removeprefix("bert."): v for k, v in weights.items()}
        try:
            self.word_embeddings = w["embeddings.word_embeddings.weight"]
            self.position_embeddings = w["embeddings.position_embeddings.weight"]
            # One segment: every token is of type 0 (sentence-transformers passes zeros).
            self.token_type_embedding = w["embeddings.token_type_embeddings.weight"][0]
            self.embedding_norm = self._norm(w, "embeddings.LayerNorm")
            self.layers = [self._layer(w, f"encoder.layer.{i}") for i in range(config.num_hidden_layers)]
        except KeyError as e:
            raise ModelLoadError(f"it has no tensor {e.args[0]}") from None
        self._gelu = _GELU_APPROXIMATION[config.hidden_act]

    def _norm(self, w: dict[str, torch.Tensor], name: str) -> _LayerNorm:
        return _LayerNorm(w[f"{name}.weight"], w[f"{name}.bias"], self.config.layer_norm_eps)

    def _layer(self, w: dict[str, torch.Tensor], p: str) -> _Layer:
        def linear(name: str) -> Linear:
            return Linear(w[f"{name}.weight"], w[f"{name}.bias"])

        qkv = [f"{p}.attention.self.{n}" for n in ("query", "key", "value")]
        return _Layer(
            qkv=Linear(torch.cat([w[f"{n}.weight"] for n in qkv]), torch.cat([w[f"{n}.bias"] for n in qkv])),
            attention_out=linear(f"{p}.attention.output.dense"),
            attention_norm=self._norm(w, f"{p}.attention.output.LayerNorm"),
            up=linear(f"{p}.intermediate.dense"),
            down=linear(f"{p}.output.dense"),
            output_norm=self._norm(w, f"{p}.output.LayerNorm"),
        )

    @property
    def dtype(self) -> torch.dtype:
        return self.word_embeddings.dtype

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, cu_seqlens: list[int]) -> torch.Tensor:
        """The last hidden states [T, hidden] of the packed token ids [T]; sequence i is rows
        cu_seqlens[i]:cu_seqlens[i + 1]."""
        positions = torch.cat([torch.arange(end - start) for start, end in pairwise(cu_seqlens)])
        x = self.word_embeddings[input_ids] + self.position_embeddings[positions] + self.token_type_embedding
        x = self.embedding_norm(x)
        for layer in self.layers:
            x = layer.attention_norm(x + layer.attention_out(self._attention(layer.qkv(x), cu_seqlens)))
            x = layer.output_norm(x + layer.down(F.gelu(layer.up(x), approximate=self._gelu)))
        return x

    def _attention(self, qkv: torch.Tensor, cu_seqlens: list[int]) -> torch.Tensor:
        # Bidirectional attention within each sequence, as one SDPA call on the sequences padded to the longest
        # (batches hold texts of near lengths: the embedder sorts them), the padding masked out of the keys. Measured
        # on a 2-core host (200 documents of up to 256 tokens, 8,192-token batches, fp32 and bf16): 3-5x the
        # throughput of SDPA on each sequence's slice in a loop (a call per sequence and layer), and a block-diagonal
        # mask over the packed rows was slower still (its T x T scores grow with the batch, not the sequence).
        rows, heads = qkv.shape[0], self.config.num_attention_heads
        starts = torch.tensor(cu_seqlens[:-1])
        lengths = torch.tensor(cu_seqlens[1:]) - starts
        offsets = torch.arange(int(lengths.max()))
        valid = offsets < lengths[:, None]  # [sequences, longest]
        index = (starts[:, None] + offsets).clamp(max=rows - 1)  # a padding slot reads some real row, masked out
        q, k, v = qkv[index].view(*index.shape, 3, heads, -1).permute(2, 0, 3, 1, 4)  # [sequences, heads, longest, d]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=valid[:, None, None, :])
        return out.transpose(1, 2).reshape(*index.shape, -1)[valid]
