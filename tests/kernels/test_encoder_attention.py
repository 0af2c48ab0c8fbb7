"""The encoder's varlen attention kernel against batchjob.model.ops.varlen_attention (padded SDPA), in the
interpreter on a CPU: mixed lengths (1, a tile exactly, past one tile), head dims that are and are not powers of two,
q/k/v as strided views of one fused qkv as BERT passes them."""

import pytest
import torch

pytest.importorskip("triton")

from batchjob.kernels import ops as kops
from batchjob.kernels.encoder_attention import BLOCK_M
from batchjob.model import ops as ref

pytestmark = pytest.mark.triton

# fp32 kernel math vs the fp32 reference: summation-order noise. fp16: one or two fp16 ulps of outputs up to ~2.
TOL = {torch.float32: dict(rtol=1e-4, atol=2e-5), torch.float16: dict(rtol=4e-3, atol=4e-3)}
LENGTHS = [1, 70, 5, BLOCK_M, 2 * BLOCK_M + 3, 1, 17]


def fused_qkv(lengths: list[int], heads: int, head_dim: int, dtype, device, seed: int = 0):
    """q, k, v [T, heads, head_dim] as views of one [T, 3 * heads * head_dim] tensor, and cu_seqlens (int32)."""
    g = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    qkv = (2 * torch.randn(t, 3 * heads * head_dim, generator=g)).to(dtype).to(device)
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return (*qkv.view(t, 3, heads, head_dim).unbind(1), cu_seqlens)


@pytest.mark.parametrize(
    "heads,head_dim,dtype",
    [
        (12, 32, torch.float32),  # all-MiniLM-L6-v2's shape
        (12, 32, torch.float16),
        (4, 64, torch.float32),  # BERT-base's head dim
        (4, 64, torch.float16),
        (3, 48, torch.float32),  # not a power of two: padded to 64
        (2, 80, torch.float16),  # padded to 128: the narrower key tiles
        (2, 8, torch.float32),  # padded to 16, the least K of tl.dot
        (2, 256, torch.float32),  # the largest head dim taken
    ],
)
def test_matches_the_torch_reference(device, heads, head_dim, dtype):
    q, k, v, cu_seqlens = fused_qkv(LENGTHS, heads, head_dim, dtype, device, seed=heads + head_dim)
    scale = head_dim**-0.5
    out = kops.varlen_attention(q, k, v, cu_seqlens, scale)
    assert out.shape == q.shape and out.dtype == dtype and not out.isnan().any()
    torch.testing.assert_close(out, ref.varlen_attention(q, k, v, cu_seqlens, scale), **TOL[dtype])


def test_a_sequence_alone_gives_the_same_rows_as_in_a_batch(device):
    """Tile shapes depend only on the head dim: a sequence's rows do not depend on what else is in the batch."""
    q, k, v, cu_seqlens = fused_qkv(LENGTHS, 4, 32, torch.float32, device)
    batch = kops.varlen_attention(q, k, v, cu_seqlens, 0.2)
    starts = cu_seqlens.tolist()
    for i in (0, 1, 4):
        rows = slice(starts[i], starts[i + 1])
        alone = torch.tensor([0, LENGTHS[i]], dtype=torch.int32, device=device)
        out = kops.varlen_attention(q[rows], k[rows], v[rows], alone, 0.2)
        torch.testing.assert_close(out, batch[rows], rtol=0, atol=0)


def test_an_empty_sequence_among_others_is_skipped(device):
    lengths = [9, 0, 40]
    q, k, v, cu_seqlens = fused_qkv(lengths, 2, 32, torch.float32, device, seed=5)
    out = kops.varlen_attention(q, k, v, cu_seqlens, 0.3)
    torch.testing.assert_close(out, ref.varlen_attention(q, k, v, cu_seqlens, 0.3), **TOL[torch.float32])
