"""The C++ CPU attention (model/cpu_attention.py) against the torch path it replaces, and its fallbacks."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch

from batchjob.kernels.testing import make_attention_case
from batchjob.model import cpu_attention, ops

needs_compiler = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler to build the op with")

# (cached prefix, query rows) per sequence
STEPS = {
    "decodes": [(p, 1) for p in (0, 1, 15, 16, 17, 200, 511, 90)],
    "prefills": [(0, 37), (0, 16), (0, 1)],
    "chunks after a cached prefix": [(33, 40), (16, 16), (100, 3)],
    "mixed": [(300, 1), (0, 70), (48, 17), (5, 1), (0, 1), (129, 33)],
}


def torch_reference(case):
    """The torch path on caches whose never-written slots (NaN) are zeroed: it reads whole padded blocks."""
    k, v = torch.nan_to_num(case.k_cache), torch.nan_to_num(case.v_cache)
    return ops.torch_paged_attention(case.q, k, v, case.meta, case.scale)


@needs_compiler
@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "page"), [(9, 3, 64, 16), (8, 2, 128, 16), (6, 2, 16, 5), (4, 4, 32, 1)]
)
def test_native_op_matches_the_torch_path(step, heads, kv_heads, head_dim, page):
    """SmolLM2's GQA shape, a Llama-3 one (head_dim 128, 4 query heads per KV head), shapes that take the generic
    loops; unwritten slots hold NaN, so any read outside a sequence's context shows."""
    case = make_attention_case(STEPS[step], heads=heads, kv_heads=kv_heads, head_dim=head_dim, page=page)
    assert cpu_attention.native_op() is not None
    out = ops.paged_attention(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    assert not case.meta.plan_cache  # the native op ran, not the torch path's plan
    torch.testing.assert_close(out, torch_reference(case), atol=2e-5, rtol=2e-5)


def test_env_var_forces_the_torch_path(monkeypatch):
    monkeypatch.setenv(cpu_attention.ENV, "torch")
    assert cpu_attention.native_op() is None
    case = make_attention_case(STEPS["mixed"], heads=9, kv_heads=3, head_dim=64, page=16)
    out = ops.paged_attention(
        case.q, torch.nan_to_num(case.k_cache), torch.nan_to_num(case.v_cache), case.meta, case.scale
    )
    assert case.meta.plan_cache  # the torch path planned its calls
    torch.testing.assert_close(out, torch_reference(case))


def test_a_failed_build_falls_back_to_the_torch_path(monkeypatch, tmp_path, caplog):
    broken = tmp_path / "paged_attention.cpp"
    broken.write_text("this is not C++\n")
    monkeypatch.setenv("BATCHJOB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(cpu_attention, "SOURCE", broken)
    monkeypatch.setattr(cpu_attention, "_state", {})
    with caplog.at_level(logging.WARNING):
        assert cpu_attention.native_op() is None
    assert "using the torch path" in caplog.text
    case = make_attention_case(STEPS["decodes"], heads=9, kv_heads=3, head_dim=64, page=16)
    out = ops.paged_attention(
        case.q, torch.nan_to_num(case.k_cache), torch.nan_to_num(case.v_cache), case.meta, case.scale
    )
    torch.testing.assert_close(out, torch_reference(case))
