"""The GPU self-test's CPU form: tiny shapes in the interpreter, checks only (no timing)."""

import pytest
import torch

pytest.importorskip("triton")

from batchjob.bench.kernel_selftest import run_selftest
from batchjob.bench.tables import format_selftest

pytestmark = pytest.mark.triton


def test_selftest_small(device):
    rows = run_selftest(device, small=True, dtype=torch.float16, reps=0)
    table = format_selftest(rows)
    kernels = {"rms_norm", "rotary", "silu_and_mul", "store_kv", "paged_attention", "varlen_attention", "fused_moe"}
    assert {r["kernel"] for r in rows} == kernels
    assert all(r["passed"] for r in rows), table
    assert table.splitlines()[-1] == f"{len(rows)}/{len(rows)} passed"


def test_format_table_reports_errors():
    rows = [
        dict(
            kernel="rotary",
            case="x",
            dtype="float16",
            shape="[1]",
            max_abs_err=None,
            tol="exact",
            passed=False,
            triton_ms=None,
            torch_ms=None,
            speedup=None,
            error="ValueError: boom",
        )
    ]
    table = format_selftest(rows)
    assert "FAIL" in table and "ValueError: boom" in table and table.endswith("0/1 passed")


def test_the_tuning_sweep_stops_at_its_deadline_with_a_row_that_does_not_fail(device):
    import time

    from batchjob.bench.kernel_selftest import run_tuning

    rows = run_tuning(device, small=True, reps=0, until=time.perf_counter() - 1)
    assert len(rows) == 1 and rows[0]["passed"] is None and "3 of 3 configurations not run" in rows[0]["error"]
