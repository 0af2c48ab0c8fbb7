"""The sparse MoE block (per-expert matmuls on the torch and CPU ops, the fused grouped GEMM on the Triton ops)
against a per-token reference: each row's softmax top-k routing and its experts' SiLU MLPs, one row at a time."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from batchjob.model import cpu_ops
from batchjob.model import ops as torch_ops
from batchjob.model.matmul.linear import Linear
from batchjob.model.moe import SparseMoeBlock

HIDDEN, INTER = 64, 32


def per_token(x, router, experts, top_k, norm_topk_prob):
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = torch.softmax(x[t] @ router.T, dim=-1)
        weights, ids = torch.topk(probs, top_k)
        if norm_topk_prob:
            weights = weights / weights.sum()
        for wt, e in zip(weights, ids.tolist()):
            gate, up, down = experts[e]
            out[t] += wt * (down @ (F.silu(gate @ x[t]) * (up @ x[t])))
    return out


@pytest.mark.parametrize("backend", ["torch", "cpu", pytest.param("triton", marks=pytest.mark.triton)])
@pytest.mark.parametrize(
    "rows,num_experts,top_k,norm", [(1, 8, 2, True), (3, 16, 2, False), (37, 8, 3, True), (64, 4, 4, False)]
)
def test_grouped_experts_equal_the_per_token_reference(backend, rows, num_experts, top_k, norm):
    """Each backend's experts: the torch ops' and the CPU's per-expert matmuls, the Triton ops' grouped GEMM (in the
    interpreter on a CPU)."""
    if backend == "triton":
        pytest.importorskip("triton", reason="the Triton kernels need triton (the test extra)")
        from batchjob.kernels import ops
    else:
        ops = torch_ops if backend == "torch" else cpu_ops
    g = torch.Generator().manual_seed(rows * num_experts + top_k)
    x = torch.randn(rows, HIDDEN, generator=g)
    router = torch.randn(num_experts, HIDDEN, generator=g) * 0.3
    shapes = ((INTER, HIDDEN), (INTER, HIDDEN), (HIDDEN, INTER))  # gate, up, down
    experts = [tuple(torch.randn(s, generator=g) * 0.2 for s in shapes) for _ in range(num_experts)]
    block = SparseMoeBlock(Linear(router), ops.moe_experts(*map(list, zip(*experts))), top_k, norm)
    with torch.inference_mode():
        got = block(x, ops)
        want = per_token(x, router, experts, top_k, norm)
        _, chosen = block.route(x)
    assert got.shape == (rows, HIDDEN)
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()
    if rows == 3:  # most experts idle: the block skips them
        assert len(set(chosen.flatten().tolist())) < num_experts
