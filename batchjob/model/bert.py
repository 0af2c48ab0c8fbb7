"""A BERT encoder (transformers' BertModel weights: absolute positions, post-LayerNorm, GELU MLP) run on packed rows.

A batch of sequences is one [T, hidden] tensor of their tokens laid end to end, no padding: every matmul and
elementwise op runs on all T rows at once, and only attention looks at the sequences one by one (`cu_seqlens`, the
row where each starts, and the end), through the ops backend's varlen_attention: torch's SDPA on a CPU, the Triton
kernel on a GPU."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from batchjob.model.backend import OpsBackend
from batchjob.model.errors import ModelLoadError
from batchjob.model.matmul.linear import Linear
from batchjob.model.packed import PackedBatch

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
    def __init__(
        self, config: BertConfig, weights: dict[str, torch.Tensor], ops: OpsBackend, device: torch.device | str = "cpu"
    ):
        """`weights` by transformers' BertModel names (a leading `bert.`, as BertFor* heads save them, is dropped),
        already in the dtype to compute in; moved to `device`."""
        self.config, self.ops = config, ops
        self.scale = 1 / math.sqrt(config.hidden_size // config.num_attention_heads)
        w = {k.removeprefix("bert."): v.to(device) for k, v in weights.items()}
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

    @property
    def device(self) -> torch.device:
        return self.word_embeddings.device

    @torch.inference_mode()
    def __call__(self, batch: PackedBatch) -> torch.Tensor:
        """The last hidden states [T, hidden] of the packed batch (on the model's device)."""
        x = self.word_embeddings[batch.input_ids] + self.position_embeddings[batch.positions]
        x = self.embedding_norm(x + self.token_type_embedding)
        for layer in self.layers:
            x = layer.attention_norm(x + layer.attention_out(self._attention(layer.qkv(x), batch.cu_seqlens)))
            x = layer.output_norm(x + layer.down(F.gelu(layer.up(x), approximate=self._gelu)))
        return x

    def _attention(self, qkv: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        rows = qkv.shape[0]
        q, k, v = qkv.view(rows, 3, self.config.num_attention_heads, -1).unbind(1)  # views [T, heads, d]
        return self.ops.varlen_attention(q, k, v, cu_seqlens, self.scale).reshape(rows, -1)
