"""Weight-only int8 and int4 (`engine.weights: int8 | int4`): a float checkpoint's decoder-layer weight matrices
quantized once at load into GGUF's block formats, then computed as a GGUF's blocks are (GGUFLinear,
csrc/gguf_matmul.cpp: a panel of output columns dequantized into cache, x against it in the engine's dtype, each
output one float32 sum). Activations are not quantized, so the results equal the dequantize-at-load path's on the
same quantized values up to the order of the sums, and a row's result does not depend on its batch.

- int8: Q8_0, symmetric int8 in groups of 32 along in_features, one fp16 scale each (8.5 bits a weight).
- int4: Q4_1, int4 in groups of 32 with an fp16 scale and an fp16 minimum (the zero) each (5 bits a weight).

gguf-py's quantizers make the blocks (bit for bit ggml's reference ones, deterministic). torch's own weight-only ops
(`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`) were measured first on this project's CPUs: 3 to 4 times
slower than the float GEMM at one row and 20 to 100 times at 16 to 2,048 rows, where the block matmul is level at one
row and within 1.6 times at 2,048 (docs/cpu.md#weight-only-int8-and-int4). Each float matrix is let go as soon as its
blocks exist: one copy of the weights."""

from __future__ import annotations

import re

import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from batchjob.model.errors import ModelError
from batchjob.model.matmul.gguf_linear import QuantizedWeight

BLOCK_TYPES = {"int8": GGMLQuantizationType.Q8_0, "int4": GGMLQuantizationType.Q4_1}
GROUP_SIZE = 32  # weights per block along in_features, in both formats
# A decoder layer's dense matmuls (fused or apart); not a sparse MoE layer's experts or router (they stay float, as
# the embedding and the LM head do).
_DENSE = re.compile(r"model\.layers\.\d+\.(self_attn\.(q|k|v|o|qkv)_proj|mlp\.(gate|up|down|gate_up)_proj)\.weight")


def quantize_weight(weight: torch.Tensor, kind: str) -> QuantizedWeight:
    """W [out_features, in_features] (in_features a multiple of GROUP_SIZE) as `kind`'s blocks, computing in W's
    dtype."""
    ggml_type = BLOCK_TYPES[kind]
    data = quantize(weight.detach().float().contiguous().numpy(), ggml_type)
    return QuantizedWeight(torch.from_numpy(data), int(ggml_type), weight.shape[1], weight.dtype)


def dense_weight_names(weights: dict[str, torch.Tensor]) -> list[str]:
    """The names of the decoder layers' dense weight matrices, those weight-only quantization takes."""
    return [name for name in weights if _DENSE.fullmatch(name)]


def quantize_dense_weights(weights: dict[str, torch.Tensor], kind: str) -> None:
    """Each decoder layer's dense weight matrix replaced in `weights` by its `kind` blocks, one at a time (the float
    matrix freed before the next is read). Raises ModelError naming a matrix whose in_features the blocks cannot
    take."""
    names = dense_weight_names(weights)
    for name in names:
        if weights[name].shape[1] % GROUP_SIZE:
            raise ModelError(
                f"{name} has {weights[name].shape[1]} input features, not a multiple of the {GROUP_SIZE} that "
                f"{kind}'s groups take"
            )
    for name in names:
        weights[name] = quantize_weight(weights[name], kind)
