"""Weight-only int8 / int4 (model/matmul/weight_only.py): the blocks gguf-py's reference quantizers make, within half
a step of each group's scale of W; the matmul over them equal to F.linear on the same values dequantized, up to the
order of float32 sums, and a row's result the same alone as in a batch; which of a checkpoint's matrices it takes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from batchjob.model.errors import ModelError
from batchjob.model.matmul.gguf_linear import GGUFLinear, computable, dequantize
from batchjob.model.matmul.weight_only import (
    BLOCK_TYPES,
    GROUP_SIZE,
    dense_weight_names,
    quantize_dense_weights,
    quantize_weight,
)

KINDS = ["int8", "int4"]
BITS_PER_WEIGHT = {"int8": 8.5, "int4": 5.0}  # int8 + an fp16 scale per 32; int4 + an fp16 scale and zero per 32


def _weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.05
    w[:, 7] *= 20  # an outlier column: only its own groups' steps widen
    return w


@pytest.mark.parametrize("kind", KINDS)
def test_each_group_of_32_is_within_half_a_step_of_its_own_scale(kind):
    w = _weight(48, 128)
    q = quantize_weight(w, kind)
    assert q.ggml_type == int(BLOCK_TYPES[kind]) and q.shape == w.shape and q.dtype == torch.float32
    assert q.nbytes * 8 == w.numel() * BITS_PER_WEIGHT[kind]
    back = dequantize(q.data, q.ggml_type, q.in_features)
    groups, err = w.view(48, -1, GROUP_SIZE), (back - w).abs().view(48, -1, GROUP_SIZE)
    levels = 127 if kind == "int8" else 15  # int8: symmetric, 127 steps to amax; int4: 15 steps from min to max
    span = groups.abs().amax(-1) if kind == "int8" else groups.amax(-1) - groups.amin(-1)
    half_step = span / levels / 2
    # fp16 scales (and int4's fp16 zero) add a rounding of their own: 1e-3 of the span covers it. One scale per row
    # would fail this on the groups beside the outlier's, whose own steps are 20 times finer.
    assert (err.amax(-1) <= half_step * 1.01 + 1e-3 * span).all()


@pytest.mark.parametrize("kind", KINDS)
def test_the_blocks_are_the_same_each_time_and_follow_the_weights_dtype(kind):
    w = _weight(32, 64, seed=3)
    assert torch.equal(quantize_weight(w, kind).data, quantize_weight(w.clone(), kind).data)
    bf16 = quantize_weight(w.to(torch.bfloat16), kind)
    assert bf16.dtype == torch.bfloat16  # computes in the model's dtype; the blocks from the bf16 values
    assert torch.equal(bf16.data, quantize_weight(w.to(torch.bfloat16).float(), kind).data)


@pytest.mark.skipif(not computable(torch.float32), reason="a CPU build with AVX-512 computes the blocks")
@pytest.mark.parametrize("kind", KINDS)
def test_the_matmul_equals_f_linear_on_the_dequantized_weight_and_a_row_alone_as_in_a_batch(kind):
    w, bias = _weight(200, 576, seed=5), torch.randn(200, generator=torch.Generator().manual_seed(6))
    q = quantize_weight(w, kind)
    lin = GGUFLinear([q], bias)
    dequantized = dequantize(q.data, q.ggml_type, q.in_features)
    x = torch.randn(300, 576, generator=torch.Generator().manual_seed(7))
    for rows in (1, 5, 64, 300):
        ours, ref = lin(x[:rows]), F.linear(x[:rows].double(), dequantized.double(), bias.double()).float()
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    batch = lin(x)
    assert torch.equal(lin(x[17:18]), batch[17:18])
    # and the quantization is what moves the result: against the float W it is off by far more than sum order
    assert (lin(x) - F.linear(x, w, bias)).abs().max() > 1e-3


def test_the_decoder_layers_dense_matrices_are_taken_and_nothing_else():
    p = "model.layers.3."
    dense = [p + f"self_attn.{n}_proj.weight" for n in "qkvo"] + [p + f"mlp.{n}_proj.weight" for n in ("gate", "up")]
    dense += [p + "mlp.down_proj.weight", p + "self_attn.qkv_proj.weight", p + "mlp.gate_up_proj.weight"]
    other = [
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.norm.weight",
        p + "input_layernorm.weight",
        p + "self_attn.q_proj.bias",
        p + "mlp.experts.0.gate_proj.weight",  # a sparse MoE layer's experts and router stay float
        p + "mlp.gate.weight",
        p + "mlp.shared_expert.up_proj.weight",
    ]
    weights = {name: _weight(64, 64) for name in dense + other}
    assert dense_weight_names(weights) == dense
    quantize_dense_weights(weights, "int4")
    assert all(weights[name].ggml_type == int(BLOCK_TYPES["int4"]) for name in dense)
    assert all(isinstance(weights[name], torch.Tensor) for name in other)


def test_in_features_that_groups_of_32_do_not_divide_are_refused_by_name_before_any_is_quantized():
    weights = {
        "model.layers.0.self_attn.q_proj.weight": _weight(64, 64),
        "model.layers.0.mlp.down_proj.weight": _weight(64, 48),
    }
    with pytest.raises(ModelError, match=r"model\.layers\.0\.mlp\.down_proj\.weight has 48 input features.* 32"):
        quantize_dense_weights(weights, "int8")
    assert all(isinstance(w, torch.Tensor) for w in weights.values())
