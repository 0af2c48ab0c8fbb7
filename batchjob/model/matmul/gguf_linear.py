"""GGUF's quantized weights kept as the file stores them, and the matmul that reads them so (csrc/gguf_matmul.cpp).

A Q4_K_M file of a 1B model is 0.7 GB; dequantized to bf16 it is 2.5 GB, and each decode step reads all of it. Kept in
its blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K), each weight matrix stays 4.5 to 8.5 bits a weight in
memory; the C++ matmul dequantizes a panel of output columns at a time into a buffer that stays in cache and computes
on it in the activations' dtype with float32 sums. The values it computes with are bit for bit those of the
dequantize-at-load path (gguf-py's dequantize, rounded to the model's dtype), so the two differ only in the order of
the sums. Activations are never quantized."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from batchjob.model.cpu_native import native_ops

# ggml's type ids of the block formats computed as they are stored; other types are dequantized at load.
GGML_TYPES = {2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}


@dataclass(frozen=True)
class QuantizedWeight:
    """W [out_features, in_features] as GGUF blocks: `data` uint8 [out_features, bytes of a row's blocks]. `dtype`
    is what it dequantizes to, and what a matmul over it computes in."""

    data: torch.Tensor
    ggml_type: int
    in_features: int
    dtype: torch.dtype = torch.float32

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.data.shape[0], self.in_features))

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def to(self, target: torch.dtype | torch.device | str) -> QuantizedWeight:
        """In another dtype (what it computes in; the blocks stay), or on a device (a CPU alone runs it)."""
        if isinstance(target, torch.dtype):
            return dataclasses.replace(self, dtype=target)
        if torch.device(target).type != "cpu":
            raise ValueError("GGUF's quantized weights are computed on a CPU; dequantize them for another device")
        return self

    def dequantize(self) -> torch.Tensor:
        return dequantize(self.data, self.ggml_type, self.in_features).to(self.dtype)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows `ids` dequantized (an embedding lookup): [*ids.shape, in_features]."""
        flat = dequantize(self.data.index_select(0, ids.reshape(-1)), self.ggml_type, self.in_features)
        return flat.to(self.dtype).view(*ids.shape, self.in_features)


def dequantize(data: torch.Tensor, ggml_type: int, in_features: int) -> torch.Tensor:
    """float32 [rows, in_features], as gguf-py's dequantize gives it (the C++ op where built: bit for bit the same)."""
    ops = native_ops()
    if ops is not None:
        return ops.gguf_dequantize(data.contiguous(), ggml_type, in_features)
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    values = gguf_dequantize(data.numpy(), GGMLQuantizationType(ggml_type))
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).view(data.shape[0], in_features)


def computable(dtype: torch.dtype) -> bool:
    """Whether this CPU's build of the C++ ops computes matmuls over GGUF blocks with x in `dtype`."""
    ops = native_ops()
    return ops is not None and ops.gguf_matmul_available(dtype)


class GGUFLinear:
    """y = x W^T + b over one or more QuantizedWeights stacked along the outputs (a fused q/k/v whose parts a GGUF
    quantizes in different types); callable on x [..., in_features] into `out_dtype` (the parts' dtype unless
    given: an LM head's float32 logits)."""

    backend = "gguf"

    def __init__(self, parts: list[QuantizedWeight], bias: torch.Tensor | None = None, out_dtype=None):
        if len({p.in_features for p in parts}) != 1 or len({p.dtype for p in parts}) != 1:
            raise ValueError("the parts of a fused GGUF matmul must share in_features and dtype")
        self.parts = parts
        self.bias = None if bias is None else bias.float().contiguous()  # added to the float32 sums
        self.dtype = parts[0].dtype
        self.out_dtype = out_dtype or self.dtype
        self.shape = torch.Size((sum(p.shape[0] for p in parts), parts[0].in_features))
        self.ops = native_ops()

    @property
    def nbytes(self) -> int:
        bias = 0 if self.bias is None else self.bias.numel() * self.bias.element_size()
        return sum(p.nbytes for p in self.parts) + bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Each output summed in float32, plus its bias, and rounded once to `out_dtype` (bf16 or float32)."""
        rows = x.reshape(-1, self.shape[1]).to(self.dtype).contiguous()
        out = torch.empty(rows.shape[0], self.shape[0], dtype=self.out_dtype)
        start = 0
        for p in self.parts:
            end = start + p.shape[0]
            bias = None if self.bias is None else self.bias[start:end]
            self.ops.gguf_matmul(rows, p.data, p.ggml_type, p.in_features, bias, out[:, start:end])
            start = end
        return out.view(*x.shape[:-1], self.shape[0])
