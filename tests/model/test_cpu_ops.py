"""The CPU ops backend (model/cpu_ops.py): its C++ kernels (cpu_native.py) against the torch ops they replace, and
the fallbacks."""

from __future__ import annotations

import logging

import pytest
import torch

from batchjob.bench.kernel_cases import make_attention_case
from batchjob.model import cpu_native, cpu_ops, ops

# (cached prefix, query rows) per sequence
STEPS = {
    "decodes": [(p, 1) for p in (0, 1, 15, 16, 17, 200, 511, 90)],
    "prefills": [(0, 37), (0, 16), (0, 1)],
    "chunks after a cached prefix": [(33, 40), (16, 16), (100, 3)],
    "mixed": [(300, 1), (0, 70), (48, 17), (5, 1), (0, 1), (129, 33)],
    "long prefill chunks": [(0, 300), (517, 250), (3, 1)],  # many 16-row tiles of the register-blocked path
}


def torch_reference(case, **options):
    """The torch path on caches whose never-written slots (NaN) are zeroed: it reads whole padded blocks."""
    k, v = torch.nan_to_num(case.k_cache), torch.nan_to_num(case.v_cache)
    return ops.paged_attention(case.q, k, v, case.meta, case.scale, **options)


@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "page"),
    [(9, 3, 64, 16), (8, 2, 128, 16), (4, 1, 256, 16), (6, 2, 16, 5), (4, 4, 32, 1)],
)
def test_native_op_matches_the_torch_path(step, heads, kv_heads, head_dim, page):
    """SmolLM2's GQA shape, a Llama-3 one (head_dim 128, 4 query heads per KV head), Gemma 3 270M's (head_dim 256),
    shapes that take the generic loops; unwritten slots hold NaN, so any read outside a sequence's context shows."""
    case = make_attention_case(STEPS[step], heads=heads, kv_heads=kv_heads, head_dim=head_dim, page=page)
    assert cpu_native.native_ops() is not None
    out = cpu_ops.paged_attention(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    assert not case.meta.plan_cache  # the native op ran, not the torch path's plan
    torch.testing.assert_close(out, torch_reference(case), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize(("window", "cap"), [(1, None), (7, None), (40, None), (None, 1.5), (20, 2.0)])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "page"), [(4, 1, 256, 16), (8, 2, 64, 5)])
def test_native_op_serves_sliding_windows_and_soft_caps(step, window, cap, heads, kv_heads, head_dim, page):
    """Gemma's options, on Gemma 3 270M's head shape and on one that otherwise takes the templated paths: windows of
    one key, shorter than a block, and across a 16-row tile; soft-capping alone and with a window."""
    case = make_attention_case(STEPS[step], heads=heads, kv_heads=kv_heads, head_dim=head_dim, page=page)
    case.scale *= 4  # scores large enough that a cap bends them
    options = dict(sliding_window=window, logits_soft_cap=cap)
    out = cpu_ops.paged_attention(case.q, case.k_cache, case.v_cache, case.meta, case.scale, **options)
    assert not case.meta.plan_cache  # the native op ran, not the torch path's plan
    ref = torch_reference(case, **options)
    if step != "prefills" or window != 40:  # (a window longer than those prompts changes nothing)
        assert not torch.allclose(ref, torch_reference(case), atol=1e-3), "the options change nothing here"
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_native_op_reads_queries_in_place_from_the_fused_qkv_rows():
    """q as the model passes it: a view of the qkv matmul's rows, K and V after it in each row."""
    case = make_attention_case(STEPS["mixed"], heads=9, kv_heads=3, head_dim=64, page=16)
    qkv = torch.cat([case.q.flatten(1), torch.full((case.q.shape[0], 2 * 3 * 64), float("nan"))], dim=1)
    q = qkv[:, : 9 * 64].view(-1, 9, 64)
    assert not q.is_contiguous()
    out = cpu_ops.paged_attention(q, case.k_cache, case.v_cache, case.meta, case.scale)
    torch.testing.assert_close(out, torch_reference(case), atol=2e-5, rtol=2e-5)


def test_env_var_forces_the_torch_path(monkeypatch):
    monkeypatch.setenv("BATCHJOB_CPU_OPS", "torch")
    assert cpu_native.native_ops() is None
    case = make_attention_case(STEPS["mixed"], heads=9, kv_heads=3, head_dim=64, page=16)
    out = cpu_ops.paged_attention(
        case.q, torch.nan_to_num(case.k_cache), torch.nan_to_num(case.v_cache), case.meta, case.scale
    )
    assert case.meta.plan_cache  # the torch path planned its calls
    torch.testing.assert_close(out, torch_reference(case))


def test_a_failed_build_falls_back_to_the_torch_path(monkeypatch, tmp_path, caplog):
    broken = tmp_path / "paged_attention.cpp"
    broken.write_text("this is not C++\n")
    monkeypatch.setenv("BATCHJOB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(cpu_native, "SOURCES", [broken])
    monkeypatch.setattr(cpu_native, "_state", {})
    with caplog.at_level(logging.WARNING):
        assert cpu_native.native_ops() is None
    assert "using the torch ops" in caplog.text
    case = make_attention_case(STEPS["decodes"], heads=9, kv_heads=3, head_dim=64, page=16)
    out = cpu_ops.paged_attention(
        case.q, torch.nan_to_num(case.k_cache), torch.nan_to_num(case.v_cache), case.meta, case.scale
    )
    torch.testing.assert_close(out, torch_reference(case))


def _rows(n, width, seed):
    return torch.randn(n, width, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("rows", [1, 37, 300])
def test_fused_rms_norm_matches_the_torch_op_in_place(rows):
    """With a residual the C++ kernel writes the sum into `residual` and the normed rows into `x`."""
    x, res, w = _rows(rows, 576, 1), _rows(rows, 576, 2), 1 + 0.1 * _rows(1, 576, 3)[0]
    ref_out, ref_res = ops.rms_norm(x, w, 1e-5, res)
    x2, res2 = x.clone(), res.clone()
    out, new_res = cpu_ops.rms_norm(x2, w, 1e-5, res2)
    assert out.data_ptr() == x2.data_ptr() and new_res.data_ptr() == res2.data_ptr()
    torch.testing.assert_close(new_res, ref_res, rtol=0, atol=0)  # the sum, exactly
    torch.testing.assert_close(out, ref_out, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(cpu_ops.rms_norm(x, w, 1e-5), ops.rms_norm(x, w, 1e-5), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "rotary_dim"),
    # the last two turn part of each head (Phi-4-mini: 96 of 128)
    [(9, 3, 64, 64), (8, 2, 128, 128), (4, 4, 32, 32), (8, 2, 128, 96), (4, 4, 32, 16)],
)
def test_fused_rotary_matches_the_torch_op_on_qkv_views(heads, kv_heads, head_dim, rotary_dim):
    t = 45
    qkv = _rows(t, (heads + 2 * kv_heads) * head_dim, 4)
    q = qkv[:, : heads * head_dim].view(t, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(t, kv_heads, head_dim)
    cos_sin = _rows(300, rotary_dim, 5)
    positions = torch.randint(0, 300, (t,), generator=torch.Generator().manual_seed(6))
    ref_q, ref_k = ops.rotary(q, k, positions, cos_sin)
    assert torch.equal(ref_q[..., rotary_dim:], q[..., rotary_dim:])  # the part past rotary_dim passes
    assert not torch.equal(ref_q[..., :rotary_dim], q[..., :rotary_dim])
    v_before = qkv[:, (heads + kv_heads) * head_dim :].clone()
    out_q, out_k = cpu_ops.rotary(q, k, positions, cos_sin)
    assert out_q.data_ptr() == q.data_ptr()  # in place: the C++ kernel ran
    torch.testing.assert_close(out_q, ref_q, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out_k, ref_k, rtol=1e-6, atol=1e-6)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim :], v_before)  # V untouched


def test_rotary_refuses_a_position_outside_the_cache():
    q, k = _rows(2, 64, 7).view(2, 1, 64), _rows(2, 64, 8).view(2, 1, 64)
    with pytest.raises(RuntimeError, match="position out of range"):
        cpu_ops.rotary(q, k, torch.tensor([0, 10]), _rows(10, 64, 9))


def test_fused_silu_and_mul_matches_the_torch_op():
    x = _rows(70, 2 * 1536, 10) * 4
    torch.testing.assert_close(cpu_ops.silu_and_mul(x), ops.silu_and_mul(x), rtol=2e-6, atol=2e-6)


def test_store_kv_writes_the_rows_at_their_slots_and_skips_negative_ones():
    t, kvh, d, blocks, bs = 20, 3, 64, 6, 16
    qkv = _rows(t, 5 * kvh * d, 11)  # K and V as strided views of a fused row, as the model passes them
    k = qkv[:, kvh * d : 2 * kvh * d].view(t, kvh, d)
    v = qkv[:, 2 * kvh * d : 3 * kvh * d].view(t, kvh, d)
    slots = torch.randperm(blocks * bs, generator=torch.Generator().manual_seed(12))[:t]
    slots[3] = -1
    caches = [torch.zeros(blocks, bs, kvh, d) for _ in range(4)]
    ops.store_kv(k, v, caches[0], caches[1], slots)
    cpu_ops.store_kv(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert caches[2].abs().sum() > 0
    with pytest.raises(RuntimeError, match="slot out of range"):
        cpu_ops.store_kv(k, v, caches[2], caches[3], torch.full((t,), blocks * bs))


# bf16: the kernels widen to float32 on load and round once on store, so they differ from a float32 computation on
# the same bf16 values by about one bf16 rounding of the result (2^-8 relative), far below what a misread K/V row,
# a wrong head or a skipped block would change.
BF16_TOL = {"rtol": 1e-2, "atol": 1e-2}


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16)


@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "page"),
    [(9, 3, 64, 16), (8, 2, 128, 16), (4, 1, 256, 16), (9, 3, 64, 5), (6, 2, 16, 5)],
)
def test_native_op_reads_a_bf16_cache(step, heads, kv_heads, head_dim, page):
    """bf16 q and KV cache (decodes, prefills, chunks over cached context, the register-blocked and the generic
    paths) against the torch op in float32 on the same bf16 values. With AVX512_BF16 the register-blocked prefill
    tiles pair up keys, which blocks of an odd size cannot hold whole: those take the widening loops."""
    case = make_attention_case(
        STEPS[step], heads=heads, kv_heads=kv_heads, head_dim=head_dim, page=page, dtype=torch.bfloat16
    )
    assert case.k_cache.dtype == torch.bfloat16
    out = cpu_ops.paged_attention(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    assert out.dtype == torch.bfloat16 and not case.meta.plan_cache  # the native op ran
    k, v = (torch.nan_to_num(c.float()) for c in (case.k_cache, case.v_cache))
    ref = ops.paged_attention(case.q.float(), k, v, case.meta, case.scale)
    torch.testing.assert_close(out.float(), ref, **BF16_TOL)


@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize(("window", "cap"), [(7, None), (40, 2.0)])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "page"), [(4, 1, 256, 16), (8, 2, 64, 16)])
def test_native_op_serves_windows_and_soft_caps_on_a_bf16_cache(step, window, cap, heads, kv_heads, head_dim, page):
    """The options on the bf16 register-blocked prefill tiles (key pairs with AVX512_BF16) and decode loops."""
    case = make_attention_case(
        STEPS[step], heads=heads, kv_heads=kv_heads, head_dim=head_dim, page=page, dtype=torch.bfloat16
    )
    options = dict(sliding_window=window, logits_soft_cap=cap)
    out = cpu_ops.paged_attention(case.q, case.k_cache, case.v_cache, case.meta, 4 * case.scale, **options)
    assert out.dtype == torch.bfloat16 and not case.meta.plan_cache  # the native op ran
    k, v = (torch.nan_to_num(c.float()) for c in (case.k_cache, case.v_cache))
    ref = ops.paged_attention(case.q.float(), k, v, case.meta, 4 * case.scale, **options)
    torch.testing.assert_close(out.float(), ref, **BF16_TOL)


@pytest.mark.parametrize("rows", [1, 37, 300])
def test_fused_rms_norm_in_bf16_matches_the_torch_op(rows):
    x, res, w = _bf16(_rows(rows, 576, 1)), _bf16(_rows(rows, 576, 2)), _bf16(1 + 0.1 * _rows(1, 576, 3)[0])
    ref_out, ref_res = ops.rms_norm(x, w, 1e-5, res)
    x2, res2 = x.clone(), res.clone()
    out, new_res = cpu_ops.rms_norm(x2, w, 1e-5, res2)
    assert out.data_ptr() == x2.data_ptr() and out.dtype == torch.bfloat16
    torch.testing.assert_close(new_res, ref_res, rtol=0, atol=0)  # one rounding of the float32 sum, as torch's
    torch.testing.assert_close(out, ref_out, **BF16_TOL)
    torch.testing.assert_close(cpu_ops.rms_norm(x, w, 1e-5), ops.rms_norm(x, w, 1e-5), **BF16_TOL)


def test_fused_rotary_in_bf16_matches_the_torch_op():
    t, heads, kv_heads, head_dim = 45, 9, 3, 64
    qkv = _bf16(_rows(t, (heads + 2 * kv_heads) * head_dim, 4))
    q = qkv[:, : heads * head_dim].view(t, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(t, kv_heads, head_dim)
    cos_sin = _rows(300, head_dim, 5)  # float32, as the model keeps it
    positions = torch.randint(0, 300, (t,), generator=torch.Generator().manual_seed(6))
    ref_q, ref_k = ops.rotary(q, k, positions, cos_sin)
    out_q, out_k = cpu_ops.rotary(q, k, positions, cos_sin)
    assert out_q.data_ptr() == q.data_ptr()  # in place: the C++ kernel ran
    torch.testing.assert_close(out_q, ref_q, **BF16_TOL)
    torch.testing.assert_close(out_k, ref_k, **BF16_TOL)


def test_fused_silu_and_mul_in_bf16_matches_the_torch_op():
    x = _bf16(_rows(70, 2 * 1536, 10) * 4)
    out = cpu_native.native_ops().silu_and_mul(x)  # called directly: the torch fallback would pass as well
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, ops.silu_and_mul(x), **BF16_TOL)


def test_store_kv_writes_a_bf16_cache():
    t, kvh, d, blocks, bs = 20, 3, 64, 6, 16
    qkv = _bf16(_rows(t, 5 * kvh * d, 11))
    k = qkv[:, kvh * d : 2 * kvh * d].view(t, kvh, d)
    v = qkv[:, 2 * kvh * d : 3 * kvh * d].view(t, kvh, d)
    slots = torch.randperm(blocks * bs, generator=torch.Generator().manual_seed(12))[:t]
    slots[3] = -1
    caches = [torch.zeros(blocks, bs, kvh, d, dtype=torch.bfloat16) for _ in range(4)]
    ops.store_kv(k, v, caches[0], caches[1], slots)
    native = cpu_native.native_ops()
    native.store_kv(k, v, caches[2], caches[3], slots)  # called directly: the fallback would pass as well
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert caches[2].abs().sum() > 0


def test_mixed_dtypes_take_the_torch_ops():
    """A float32 q over a bf16 cache (or any other mix) has no C++ kernel: the torch op runs."""
    assert cpu_native.native_ops_for(torch.device("cpu"), torch.float32, torch.bfloat16) is None
    assert cpu_native.native_ops_for(torch.device("cpu"), torch.float16) is None


@pytest.mark.parametrize("rows, width", [(1, 7), (37, 49152), (300, 100)])
def test_count_greater_matches_the_torch_op(rows, width):
    """A token's rank from its row of logprobs: ties and values equal to the threshold are not above it."""
    x = torch.randn(rows, width).log_softmax(-1)
    x[:, : width // 3] = x[:, :1]  # values equal to the threshold
    threshold = x.gather(1, torch.randint(0, width, (rows, 1)))
    got = cpu_ops.count_greater(x, threshold)
    assert got.dtype == torch.int64 and torch.equal(got, ops.count_greater(x, threshold))
    assert torch.equal(cpu_ops.count_greater(x, x[:, :1]), (x > x[:, :1]).sum(-1))
