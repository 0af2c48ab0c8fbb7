"""KV store kernel against batchjob.model.ops.store_kv, in the interpreter on a CPU."""

import pytest
import torch

pytest.importorskip("triton")

import triton
import triton.language as tl

from batchjob.kernels import ops as kops
from batchjob.kernels.common import INTERPRET, fp32_to_e4m3_bits
from batchjob.model import ops as ref

pytestmark = pytest.mark.triton


@triton.jit
def _convert(x_ptr, y_ptr, n, BLOCK: tl.constexpr, INTERPRET: tl.constexpr):
    """The conversion store_kv uses: the manual one in the interpreter, the hardware cast on a GPU."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    if INTERPRET:
        bits = fp32_to_e4m3_bits(x)
    else:
        bits = x.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    tl.store(y_ptr + offs, bits, mask=offs < n)


def _inputs(device, dtype, T=7, kvh=3, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    kv = (2 * torch.randn(T, 2 * kvh * d + 8, generator=g)).to(device, dtype)  # as views of a fused projection
    k = kv[:, : kvh * d].view(T, kvh, d)
    v = kv[:, kvh * d : 2 * kvh * d].view(T, kvh, d)
    k[1, 2] = 0  # an all-zero head: the scale clamps to 1e-6 / 448
    slots = torch.tensor([5, 0, -1, 31, 16, 17, -1][:T], dtype=torch.int64, device=device)
    return k, v, slots


@pytest.mark.parametrize(
    "dtype,cache_dtype",
    [(torch.float32, torch.float32), (torch.float16, torch.float16), (torch.float32, torch.float16)],
)
def test_store_kv(device, dtype, cache_dtype):
    k, v, slots = _inputs(device, dtype)
    shape = (4, 8, 3, 64)  # 4 blocks of 8 slots
    caches = [torch.full(shape, -7.0, dtype=cache_dtype, device=device) for _ in range(4)]
    kops.store_kv(k, v, caches[0], caches[1], slots)
    ref.store_kv(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


@pytest.mark.parametrize("dtype,head_dim", [(torch.float32, 64), (torch.float16, 128)])
def test_store_kv_fp8(device, dtype, head_dim):
    """Bit-exact fp8 bytes and scales: the kernel quantizes as quantize_fp8 does (amax / 448, round to nearest
    even, saturating)."""
    k, v, slots = _inputs(device, dtype, d=head_dim, seed=1)
    shape = (4, 8, 3, head_dim)

    def fresh():
        return (
            torch.zeros(shape, dtype=torch.uint8, device=device).view(ref.FP8_DTYPE),
            torch.zeros(shape, dtype=torch.uint8, device=device).view(ref.FP8_DTYPE),
            torch.full(shape[:3], -1.0, device=device),
            torch.full(shape[:3], -1.0, device=device),
        )

    mine, theirs = fresh(), fresh()
    kops.store_kv(k, v, mine[0], mine[1], slots, mine[2], mine[3])
    ref.store_kv(k, v, theirs[0], theirs[1], slots, theirs[2], theirs[3])
    for a, b in zip(mine[:2], theirs[:2]):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    for a, b in zip(mine[2:], theirs[2:]):
        assert torch.equal(a, b)


def test_fp8_rounding_exhaustive(device):
    """The interpreter's own fp32->fp8 cast is wrong when rounding carries into the exponent; the kernel's
    conversion must match torch on every fp8 value, every midpoint between neighbours and a spread of others."""
    codes = torch.arange(256, dtype=torch.uint8)
    vals = codes.view(ref.FP8_DTYPE).float()
    vals = vals[vals.isfinite()].unique()
    mids = (vals[1:] + vals[:-1]) / 2
    g = torch.Generator().manual_seed(0)
    x = torch.cat(
        [
            vals,
            mids,
            torch.randn(2000, generator=g) * 100,
            torch.randn(500, generator=g) * 1e-3,
            torch.tensor([450.0, 463.9, -470.0, 1e-9, -0.0]),
        ]
    ).to(device)
    y = torch.empty(x.shape, dtype=torch.uint8, device=device)
    _convert[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024, INTERPRET=INTERPRET)
    want = x.to(ref.FP8_DTYPE).view(torch.uint8)
    bad = (y != want).nonzero().flatten()
    assert bad.numel() == 0, [(x[i].item(), y[i].item(), want[i].item()) for i in bad[:5]]
