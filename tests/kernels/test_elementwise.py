"""RMSNorm, rotary and SiLU-and-mul kernels against batchjob.model.ops (the reference), in the interpreter on a CPU."""

import pytest
import torch

pytest.importorskip("triton")

from batchjob.kernels import ops as kops
from batchjob.model import ops as ref

pytestmark = pytest.mark.triton

# fp32: a few ulps of reduction-order noise; fp16: one or two ulps of the output (|values| up to ~4)
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=2e-3, atol=4e-3)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("hidden", [64, 72])
def test_rms_norm(device, dtype, hidden):
    g = torch.Generator().manual_seed(hidden)
    x = torch.randn(5, hidden, generator=g).to(device, dtype)
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(device, dtype)
    torch.testing.assert_close(kops.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rms_norm_fused_residual(device, dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(7, 96, generator=g).to(device, dtype)
    res = torch.randn(7, 96, generator=g).to(device, dtype)
    w = (1 + 0.1 * torch.randn(96, generator=g)).to(device, dtype)
    x0, res0 = x.clone(), res.clone()
    out, new_res = kops.rms_norm(x, w, 1e-5, res)
    ref_out, ref_res = ref.rms_norm(x, w, 1e-5, res)
    torch.testing.assert_close(new_res, ref_res, rtol=0, atol=0)  # the rounded sum, exactly
    torch.testing.assert_close(out, ref_out, **TOL[dtype])
    assert torch.equal(x, x0) and torch.equal(res, res0), "inputs must not be written"


def test_rms_norm_head_rows_and_strided_input(device):
    """3-D input (a per-head norm) and a non-contiguous row view."""
    g = torch.Generator().manual_seed(2)
    big = torch.randn(6, 3 * 32, generator=g).to(device)
    x = big[:, 32:64]  # row stride 96
    w = torch.randn(32, generator=g).to(device)
    torch.testing.assert_close(kops.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6), **TOL[torch.float32])
    x3 = big.view(6, 3, 32)
    torch.testing.assert_close(kops.rms_norm(x3, w, 1e-6), ref.rms_norm(x3, w, 1e-6), **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,head_dim,rotary_dim", [(9, 3, 64, 64), (4, 2, 128, 128), (4, 2, 128, 96)])
def test_rotary(device, dtype, heads, kv_heads, head_dim, rotary_dim):
    """q/k as the model passes them: non-contiguous views of a fused qkv projection; rotary_dim < head_dim is
    partial rotary (Phi-4-mini's 96 of 128), the rest of each head copied."""
    g = torch.Generator().manual_seed(heads)
    T, max_pos = 6, 50
    qkv = torch.randn(T, (heads + 2 * kv_heads) * head_dim, generator=g).to(device, dtype)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.view(T, heads, head_dim), k.view(T, kv_heads, head_dim)
    inv = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float64), inv)
    cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1).float().to(device)
    positions = torch.tensor([0, 1, 17, 49, 3, 3], dtype=torch.int64, device=device)
    qo, ko = kops.rotary(q, k, positions, cache)
    rq, rk = ref.rotary(q, k, positions, cache)
    assert qo.shape == rq.shape and ko.shape == rk.shape and qo.dtype == dtype
    torch.testing.assert_close(qo, rq, **TOL[dtype])
    torch.testing.assert_close(ko, rk, **TOL[dtype])
    assert torch.equal(qo[..., rotary_dim:], q[..., rotary_dim:])
    assert torch.equal(ko[..., rotary_dim:], k[..., rotary_dim:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("inter", [40, 1100])
def test_silu_and_mul(device, dtype, inter):
    g = torch.Generator().manual_seed(inter)
    x = (3 * torch.randn(3, 2 * inter, generator=g)).to(device, dtype)
    torch.testing.assert_close(kops.silu_and_mul(x), ref.silu_and_mul(x), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("inter", [40, 1100])
def test_gelu_tanh_and_mul(device, dtype, inter):
    g = torch.Generator().manual_seed(inter)
    x = (3 * torch.randn(3, 2 * inter, generator=g)).to(device, dtype)
    torch.testing.assert_close(kops.gelu_tanh_and_mul(x), ref.gelu_tanh_and_mul(x), **TOL[dtype])
