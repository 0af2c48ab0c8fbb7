"""GGUF's blocks computed as they are stored (csrc/gguf_matmul.cpp): the values equal gguf-py's dequantize bit for
bit, the matmul equals F.linear on them up to the order of sums, and a row's result does not depend on its batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from batchjob.model.cpu_native import native_ops
from batchjob.model.matmul.gguf_linear import GGML_TYPES, GGUFLinear, QuantizedWeight, computable, dequantize

gguf = pytest.importorskip("gguf")
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType  # noqa: E402
from gguf.quants import dequantize as gguf_dequantize  # noqa: E402

# Byte offsets of each type's fp16 scales (d, and dmin or m) within a block.
SCALE_OFFSETS = {2: [0], 3: [0, 2], 6: [0], 7: [0, 2], 8: [0], 12: [0, 2], 13: [0, 2], 14: [208]}


def random_blocks(ggml_type: int, rows: int, k: int, seed: int = 0) -> torch.Tensor:
    """Random GGUF blocks [rows, k / block * bytes] whose fp16 scales are finite, of a trained model's scale."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    raw = rng.integers(0, 256, (rows, k // block, size), dtype=np.uint8)
    for offset in SCALE_OFFSETS[ggml_type]:
        scales = rng.uniform(0.5, 2.0, (rows, k // block)) * 10.0 ** rng.integers(-5, -1, (rows, k // block))
        raw[..., offset : offset + 2] = scales.astype(np.float16).view(np.uint8).reshape(rows, k // block, 2)
    return torch.from_numpy(raw.reshape(rows, -1))


def weight(ggml_type: int, rows: int, k: int, dtype: torch.dtype, seed: int = 0) -> QuantizedWeight:
    return QuantizedWeight(random_blocks(ggml_type, rows, k, seed), ggml_type, k, dtype)


needs_kernel = pytest.mark.skipif(native_ops() is None, reason="the C++ ops are switched off (BATCHJOB_CPU_OPS=torch)")


@pytest.mark.parametrize("ggml_type", list(GGML_TYPES))
def test_dequantized_values_are_gguf_pys_bit_for_bit(ggml_type):
    data = random_blocks(ggml_type, 37, 512)
    want = gguf_dequantize(data.numpy(), GGMLQuantizationType(ggml_type)).reshape(37, 512)
    assert np.array_equal(dequantize(data, ggml_type, 512).numpy(), want)
    ids = torch.tensor([[5, 0], [36, 5]])
    q = QuantizedWeight(data, ggml_type, 512, torch.bfloat16)
    assert torch.equal(q.rows(ids), torch.from_numpy(want)[ids].to(torch.bfloat16))


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ggml_type", list(GGML_TYPES))
def test_the_matmul_reads_the_same_values_and_sums_them_as_f_linear(ggml_type, dtype):
    if not computable(dtype):
        pytest.skip(f"this CPU's build computes no GGUF matmul in {dtype}")  # bf16 without AVX512_BF16
    k = 512
    q = weight(ggml_type, 45, k, dtype)
    linear = GGUFLinear([q], out_dtype=torch.float32)
    # x = I: each output is one weight times 1 plus zeros, exact: the values the panel computed with, bit for bit.
    assert torch.equal(linear(torch.eye(k, dtype=dtype)), q.dequantize().float().T)
    x = torch.randn(19, k).to(dtype)
    want = F.linear(x.float(), q.dequantize().float())
    torch.testing.assert_close(linear(x), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_result_does_not_depend_on_its_batch(dtype):
    if not computable(dtype):
        pytest.skip(f"this CPU's build computes no GGUF matmul in {dtype}")
    k = 768  # three Q6_K blocks a row; 70 output columns: a last, partial panel and microkernel
    linear = GGUFLinear([weight(14, 70, k, dtype)])
    x = (torch.randn(70, k) * torch.where(torch.arange(k) % 7 == 0, 100.0, 1.0)).to(dtype)
    alone = torch.cat([linear(row[None]) for row in x])
    for rows in (2, 5, 6, 7, 13, 64, 70):
        assert torch.equal(linear(x[:rows]), alone[:rows]), rows
    assert linear(x.view(7, 10, k)).shape == (7, 10, 70) and linear(x).dtype == dtype


@needs_kernel
@pytest.mark.skipif(not computable(torch.bfloat16), reason="a CPU build with AVX512_BF16")
def test_bf16_results_are_the_biased_float32_sums_rounded_once():
    q, bias = weight(12, 40, 512, torch.bfloat16), torch.randn(40)
    x = torch.randn(11, 512).to(torch.bfloat16)
    sums = GGUFLinear([q], out_dtype=torch.float32)(x)
    assert torch.equal(GGUFLinear([q], bias)(x), (sums + bias).to(torch.bfloat16))


@needs_kernel
def test_a_fused_matmul_stacks_parts_of_different_types_and_adds_the_bias():
    k = 256
    parts = [weight(t, n, k, torch.float32, seed=n) for t, n in ((12, 40), (14, 8), (8, 24))]  # q4_k, q6_k, q8_0
    bias = torch.randn(72)
    x = torch.randn(9, k)
    fused = GGUFLinear(parts, bias)
    alone = torch.cat([GGUFLinear([p])(x) for p in parts], dim=1) + bias
    assert torch.equal(fused(x), alone) and fused.shape == (72, k)
    assert fused.nbytes == sum(p.data.numel() for p in parts) + 72 * 4
    with pytest.raises(ValueError, match="in_features"):
        GGUFLinear([parts[0], weight(8, 4, 512, torch.float32)])


@needs_kernel
def test_blocks_of_the_wrong_size_are_refused_not_read_past():
    data, ops = random_blocks(8, 4, 64), native_ops()
    for bad in (data[:, :-1].contiguous(), data.view(torch.int8), data.t()):
        with pytest.raises(RuntimeError, match="gguf"):
            ops.gguf_dequantize(bad, 8, 64)
    with pytest.raises(RuntimeError, match="no kernel for ggml type"):
        ops.gguf_dequantize(data, 9, 64)
    with pytest.raises(RuntimeError, match="x has 32 features"):
        ops.gguf_matmul(torch.zeros(2, 32), data, 8, 64, None, torch.empty(2, 4))
    with pytest.raises(RuntimeError, match="out must be"):
        ops.gguf_matmul(torch.zeros(2, 64), data, 8, 64, None, torch.empty(4, 2).t())
    with pytest.raises(RuntimeError, match="bias must be"):
        ops.gguf_matmul(torch.zeros(2, 64), data, 8, 64, torch.zeros(3), torch.empty(2, 4))
    with pytest.raises(ValueError, match="on a CPU"):
        QuantizedWeight(data, 8, 64).to("meta")
