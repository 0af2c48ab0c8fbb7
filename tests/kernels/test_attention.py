"""Paged attention kernels against batchjob.model.ops.paged_attention, in the interpreter on a CPU.

Steps are built by batchjob.kernels.testing.make_attention_case from (cached prefix, query rows) pairs: prefix 0 is a
fresh prefill, a prefix > 0 with several rows is a prefill chunk with a prefix hit, one row is a decode. Unwritten cache
slots hold NaN, so that a read outside a sequence's context would show."""

import pytest
import torch

pytest.importorskip("triton")

from batchjob.bench.kernel_cases import make_attention_case
from batchjob.kernels import ops as kops
from batchjob.kernels.attention import DECODE_BLOCK_N, SPLIT_SIZE, paged_attention_impl
from batchjob.model import ops as ref
from batchjob.model.attention_metadata import AttentionMetadata

pytestmark = pytest.mark.triton

# fp32 kernel math vs the fp32 reference: summation-order noise. fp16: one or two fp16 ulps of outputs up to ~2.
TOL = {torch.float32: dict(rtol=1e-4, atol=2e-5), torch.float16: dict(rtol=4e-3, atol=4e-3)}

MIXED = [(0, 37), (20, 13), (32, 16), (0, 1), (40, 1), (77, 1), (5, 70)]  # ragged, page-aligned and unaligned


def _check(case, out, dtype):
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    assert not out.isnan().any()
    torch.testing.assert_close(out, case.reference(), **TOL[dtype])


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,page,dtype",
    [
        (9, 3, 64, 16, torch.float32),  # SmolLM2 shape: group 3
        (9, 3, 64, 16, torch.float16),
        (4, 4, 64, 8, torch.float32),  # group 1 (MHA), small pages
        (8, 2, 128, 16, torch.float16),  # group 4, head dim 128
        (8, 2, 128, 16, torch.float32),  # fp32 at head dim 128: smaller tiles (varlen_tiles)
        (4, 1, 256, 16, torch.float16),  # head dim 256 (Gemma 3), group 4: smaller tiles too
        (16, 2, 64, 32, torch.float32),  # group 8
        (6, 2, 48, 16, torch.float32),  # group 3, head dim not a power of two
    ],
)
def test_mixed_step(device, heads, kv_heads, head_dim, page, dtype):
    case = make_attention_case(
        MIXED,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        page=page,
        dtype=dtype,
        device=device,
        seed=heads + page,
    )
    _check(case, kops.paged_attention(case.q, case.k_cache, case.v_cache, case.meta, case.scale), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fp8_cache(device, dtype):
    """Dequantization inside the kernel; the reference reads the same fp8 bytes and scales."""
    case = make_attention_case(
        MIXED, heads=9, kv_heads=3, head_dim=64, page=16, dtype=dtype, cache_dtype=ref.FP8_DTYPE, device=device, seed=3
    )
    out = kops.paged_attention(case.q, case.k_cache, case.v_cache, case.meta, case.scale, *case.scales)
    _check(case, out, dtype)


def test_store_then_attend_fp8(device):
    """The layer's sequence with both kernels: store the step's K/V into an fp8 cache, then attend."""
    case = make_attention_case(
        [(16, 9), (3, 1), (0, 21)],
        heads=8,
        kv_heads=2,
        head_dim=64,
        page=8,
        cache_dtype=ref.FP8_DTYPE,
        device=device,
        seed=4,
    )
    # the cache as it was before this step: the step's slots still unwritten (NaN bytes / NaN scales)
    slots = case.meta.slot_mapping
    mine = [t.clone() for t in (case.k_cache, case.v_cache, case.k_scale, case.v_scale)]
    for c in mine[:2]:
        c.view(torch.uint8).view(-1, *c.shape[2:])[slots] = 0x7F
    for c in mine[2:]:
        c.view(-1, c.shape[-1])[slots] = float("nan")
    kops.store_kv(case.step_k, case.step_v, mine[0], mine[1], slots, mine[2], mine[3])
    for a, b in zip(mine, (case.k_cache, case.v_cache, case.k_scale, case.v_scale)):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    out = kops.paged_attention(case.q, mine[0], mine[1], case.meta, case.scale, mine[2], mine[3])
    _check(case, out, torch.float32)


@pytest.mark.parametrize(
    "specs",
    [
        [(0, 1), (1, 1), (63, 1), (64, 1), (150, 1), (257, 1)],  # decodes only: 1 to 5 splits of 64
        [(100, 1), (0, 40), (129, 1), (64, 17)],  # mixed, decodes past split boundaries
    ],
)
def test_split_kv_decode(device, specs):
    case = make_attention_case(specs, heads=9, kv_heads=3, head_dim=64, page=16, device=device, seed=5)
    out = paged_attention_impl(case.q, case.k_cache, case.v_cache, case.meta, case.scale, split_size=DECODE_BLOCK_N)
    _check(case, out, torch.float32)


def test_default_split_size(device):
    """A decode past SPLIT_SIZE through the public function (two splits plus the merge)."""
    case = make_attention_case(
        [(SPLIT_SIZE + 40, 1), (7, 1), (9, 5)], heads=4, kv_heads=2, head_dim=64, page=16, device=device, seed=6
    )
    _check(case, kops.paged_attention(case.q, case.k_cache, case.v_cache, case.meta, case.scale), torch.float32)


@pytest.mark.parametrize("window,cap", [(5, None), (16, None), (64, None), (None, 2.0), (19, 1.5)])
@pytest.mark.parametrize("split_decodes", [True, False])
def test_sliding_window_and_soft_cap(device, window, cap, split_decodes):
    """Gemma's options: windows shorter than a page, a page and a tile, and past several decode splits (split size 64,
    so whole splits fall before the window); soft-capping alone and with a window."""
    case = make_attention_case(
        MIXED + [(150, 1), (90, 9)], heads=8, kv_heads=2, head_dim=32, page=16, device=device, seed=window or 9
    )
    options = dict(sliding_window=window, logits_soft_cap=cap)
    kwargs = dict(split_decodes=split_decodes, split_size=DECODE_BLOCK_N)
    out = paged_attention_impl(case.q, case.k_cache, case.v_cache, case.meta, 4 * case.scale, **options, **kwargs)
    case.scale *= 4  # scores large enough that a cap bends them
    ref_out = case.reference(**options)
    assert not torch.allclose(ref_out, case.reference(), atol=1e-3), "the options change nothing here"
    assert out.shape == case.q.shape and not out.isnan().any()
    torch.testing.assert_close(out, ref_out, **TOL[torch.float32])


def test_varlen_kernel_serves_decodes(device):
    """With the split path off, the varlen kernel alone serves the whole mixed step."""
    case = make_attention_case(MIXED, heads=9, kv_heads=3, head_dim=64, page=16, device=device, seed=7)
    out = paged_attention_impl(case.q, case.k_cache, case.v_cache, case.meta, case.scale, split_decodes=False)
    _check(case, out, torch.float32)


def test_batch_invariance(device):
    """A row's result is bit-identical whatever else is in the step (fixed tiles and fixed split size)."""
    alone = make_attention_case([(150, 1), (30, 9)], heads=9, kv_heads=3, head_dim=64, page=16, device=device, seed=8)
    out_alone = paged_attention_impl(
        alone.q, alone.k_cache, alone.v_cache, alone.meta, alone.scale, split_size=DECODE_BLOCK_N
    )
    # the same two sequences (same cache contents, same q rows) after other work in a bigger step
    c = alone
    extra_q = torch.randn(25, 9, 64, device=device)
    q = torch.cat([extra_q, c.q])
    lens = [5, 20] + c.meta.query_lens_host
    seq_lens = [300, 20] + c.meta.seq_lens_host
    nb = c.k_cache.shape[0]
    # two extra sequences that read blocks 0.. of the same cache (contents do not matter for the checked rows)
    tables = torch.full((4, max(c.meta.block_tables.shape[1], 19)), -1, dtype=torch.int32, device=device)
    tables[0, :19] = torch.arange(19) % nb
    tables[1, :2] = torch.tensor([0, 1])
    tables[2:, : c.meta.block_tables.shape[1]] = c.meta.block_tables
    k_cache = torch.nan_to_num(c.k_cache)
    v_cache = torch.nan_to_num(c.v_cache)
    qsl = [0, 5, 25, 26, 35]
    meta = AttentionMetadata(
        torch.tensor(qsl, dtype=torch.int32, device=device),
        torch.tensor(seq_lens, dtype=torch.int32, device=device),
        tables,
        torch.zeros(35, dtype=torch.int64, device=device),
        20,
        300,
        lens,
        seq_lens,
    )
    out_big = paged_attention_impl(q, k_cache, v_cache, meta, c.scale, split_size=DECODE_BLOCK_N)
    assert torch.equal(out_big[25:], out_alone)
