"""The fused-MoE grouped GEMM (kernels/moe.py) against the torch reference's per-expert matmuls (model/ops.py), in
the interpreter on a CPU: the pairs' sort and padding, and whole MoE MLPs at decode and prefill sizes, with idle
experts and shapes that do not fill the tiles; no step of it reads a device value on the host."""

import pytest
import torch

pytest.importorskip("triton")

from batchjob.engine.host_sync import HostSync, forbid_host_sync
from batchjob.kernels import ops as kops
from batchjob.kernels.moe import _block_m, moe_align_block_size
from batchjob.model import ops as ref

pytestmark = pytest.mark.triton

# fp32: reduction-order noise; fp16: a rounding step or two of the intermediate and output (|values| up to ~4)
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=4e-3, atol=4e-3)}


def routing(rows: int, num_experts: int, top_k: int, idle: int, g: torch.Generator):
    """Each row's k distinct experts among the first num_experts - idle (the last `idle` get no row), and
    weights summing to 1."""
    ids = torch.rand(rows, num_experts - idle, generator=g).topk(top_k, dim=-1).indices
    weights = torch.rand(rows, top_k, generator=g) + 0.1
    return weights / weights.sum(-1, keepdim=True), ids


@pytest.mark.parametrize("rows,num_experts,top_k,block_m", [(1, 8, 2, 16), (5, 4, 1, 4), (37, 8, 2, 16), (9, 3, 3, 8)])
def test_align_sorts_pairs_by_expert_in_padded_runs(device, rows, num_experts, top_k, block_m):
    g = torch.Generator().manual_seed(rows)
    _, ids = routing(rows, num_experts, top_k, 1 if top_k < num_experts - 1 else 0, g)
    sorted_ids, expert_ids, post_padded = moe_align_block_size(ids.to(device), num_experts, block_m)
    sorted_ids, expert_ids, post_padded = sorted_ids.cpu(), expert_ids.cpu(), post_padded.cpu()
    pairs = rows * top_k
    flat = ids.flatten()
    counts = torch.bincount(flat, minlength=num_experts)
    assert int(post_padded) == int(((counts + block_m - 1) // block_m * block_m).sum())
    # the worst case's buffer, whatever the routing: its size depends on host values only
    assert sorted_ids.numel() == -(-(pairs + min(num_experts, pairs) * (block_m - 1)) // block_m) * block_m
    assert expert_ids.numel() * block_m == sorted_ids.numel()
    real = sorted_ids[: int(post_padded)].view(-1, block_m)
    want = []
    for b, block in enumerate(real):
        e = int(expert_ids[b])
        ok = block[block < pairs]
        assert ok.numel() and (flat[ok.long()] == e).all(), "a real block holds its expert's pairs, at least one"
        want.append(ok)
    got = torch.cat(want)
    assert got.tolist() == torch.argsort(flat, stable=True).tolist()  # by expert, pair order within one
    assert sorted_ids[int(post_padded) :].eq(pairs).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    # T = 1 (decode), T past BLOCK_M (16, 32, 64 as the pairs an expert grow), top-k 1 to 3, idle experts; hidden and
    # intermediate sizes that are not multiples of the 64-wide tiles
    "rows,num_experts,top_k,idle,hidden,inter",
    [(1, 8, 2, 0, 40, 24), (1, 4, 1, 2, 72, 48), (37, 8, 2, 3, 40, 24), (70, 4, 1, 1, 72, 48), (130, 6, 3, 1, 40, 24)],
)
def test_fused_moe_equals_the_per_expert_reference(device, dtype, rows, num_experts, top_k, idle, hidden, inter):
    g = torch.Generator().manual_seed(rows * num_experts + top_k)
    gate, up, down = ([torch.randn(*s, generator=g) * 0.2 for _ in range(num_experts)] for s in
                      ((inter, hidden), (inter, hidden), (hidden, inter)))  # fmt: skip
    x = torch.randn(rows, hidden, generator=g)
    weights, ids = routing(rows, num_experts, top_k, idle, g)

    def on(ts):
        return [t.to(device, dtype) for t in ts]

    got = kops.fused_moe(x.to(device, dtype), kops.moe_experts(on(gate), on(up), on(down)), on([weights])[0],
                         ids.to(device))  # fmt: skip
    want = ref.fused_moe(x.to(dtype), ref.moe_experts(*map(on, (gate, up, down))), weights.to(dtype), ids)
    assert got.shape == (rows, hidden) and got.dtype == dtype
    torch.testing.assert_close(got.cpu(), want.cpu(), **TOL[dtype])
    if rows >= 37:
        assert _block_m(rows * top_k, num_experts) < rows  # rows span several blocks of an expert, or many experts


def test_no_host_read_in_the_fused_moe_and_one_in_the_reference():
    """forbid_host_sync on a CPU raises at the ops that would wait on a GPU: the reference sizes its matmuls from
    counts (torch.bincount, which reads its largest id on the host); the Triton path reads nothing."""
    g = torch.Generator().manual_seed(3)
    gate, up, down = ([torch.randn(*s, generator=g) for _ in range(4)] for s in ((8, 16), (8, 16), (16, 8)))
    x = torch.randn(5, 16, generator=g)
    weights, ids = routing(5, 4, 2, 1, g)
    stacked, linears = kops.moe_experts(gate, up, down), ref.moe_experts(gate, up, down)
    with forbid_host_sync(torch.device("cpu")):
        got = kops.fused_moe(x, stacked, weights, ids)
        with pytest.raises(HostSync):
            ref.fused_moe(x, linears, weights, ids)
    torch.testing.assert_close(got, ref.fused_moe(x, linears, weights, ids), **TOL[torch.float32])
