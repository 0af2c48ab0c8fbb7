"""`batchjob selftest --device cpu`: the device check's parts on tiny shapes in Triton's interpreter, and its guard
(a failing part is recorded and the next one runs; the JSON holds what was measured)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("triton")

from click.testing import CliRunner

from batchjob.bench.device_check import Check, TimeCap
from batchjob.bench.tables import format_check
from batchjob.cli import main


@pytest.mark.slow
def test_selftest_cpu_runs_every_part_and_writes_one_json(tmp_path):
    out = tmp_path / "check.json"
    result = CliRunner().invoke(main, ["selftest", "--device", "cpu", "--json", str(out)])
    report = json.loads(out.read_text())
    assert result.exit_code == 0, result.output
    assert {p: v["status"] for p, v in report["parts"].items()} == dict.fromkeys(
        ("kernels", "equality", "throughput", "graphs", "sampling", "host_sync", "kv_sizing"), "passed"
    )
    rows = report["rows"]
    kernels = {r["check"].split()[0] for r in rows if r["part"] == "kernels"}
    assert kernels == {"rms_norm", "rotary", "silu_and_mul", "store_kv", "paged_attention", "fused_moe"}
    assert any("fp8" in r["check"] for r in rows if r["part"] == "kernels")
    tuning = [r for r in rows if r["part"] == "kernels" and "tuning" in r["check"]]
    assert len(tuning) >= 3 and all(r["ok"] for r in tuning) and any("(default)" in r["check"] for r in tuning)
    [eq] = [r for r in rows if r["part"] == "equality"]
    assert eq["ok"] and eq["sequences_equal"] == "3/3" and eq["preemptions_torch"] > 0
    assert eq["longest_prompt_torch"] > eq["token_budget_torch"]  # prefilled in chunks
    [graphs] = [r for r in rows if r["part"] == "graphs"]  # the padded decode body against eager steps
    assert graphs["ok"] and graphs["sequences_equal"] == "3/3" and graphs["graphs_decode_tokens_per_s"] > 0
    sampling = {r["check"]: r for r in rows if r["part"] == "sampling"}
    assert sampling["device sampler == host sampler (seeded rows)"]["ok"]
    assert sampling["JSON-constrained outputs parse"]["ok"]
    assert sampling["the draw never waits for the device"]["ok"]
    assert all(sampling[f"{k} tokens/s vs greedy"]["share"] > 0 for k in ("sampled", "json", "sampled+json"))
    [sync] = [r for r in rows if r["part"] == "host_sync"]
    assert sync["ok"] and sync["error"] is None and sync["mixed_steps"] > 0 and sync["preemptions"] > 0
    systems = {r["check"].rsplit(" ", 1)[1] for r in rows if r["part"] == "throughput" and "tiny-llama" in r["check"]}
    assert systems == {"triton", "torch", "hf"}
    assert report["peaks"]["matmul_flops"] > 0 and "decode_hbm_gb_per_s" in report["throughput"]["2x8/2/torch"]
    assert result.output.rstrip().endswith("ALL PASSED")


def test_a_failing_part_is_recorded_and_the_next_one_runs(tmp_path, monkeypatch):
    def boom(self, deadline):
        raise RuntimeError("no kernel today")

    def capped(self, deadline):
        self.row("equality", "first", True)
        raise TimeCap("the rest")

    def measured(self, deadline):
        self.row("throughput", "figure", None, tokens_per_s=12.5)

    monkeypatch.setattr(Check, "kernels", boom)
    monkeypatch.setattr(Check, "equality", capped)
    monkeypatch.setattr(Check, "throughput", measured)
    monkeypatch.setattr(Check, "graphs", lambda self, deadline: None)
    monkeypatch.setattr(Check, "sampling", lambda self, deadline: None)
    monkeypatch.setattr(Check, "host_sync", lambda self, deadline: None)
    monkeypatch.setattr(Check, "kv_sizing", lambda self, deadline: self.row("kv_sizing", "pool", False))
    out = tmp_path / "check.json"
    report = Check("cpu", str(out)).run()
    assert {p: v["status"] for p, v in report["parts"].items()} == {
        "kernels": "failed",
        "equality": "capped",
        "throughput": "passed",
        "graphs": "passed",
        "sampling": "passed",
        "host_sync": "passed",
        "kv_sizing": "failed",
    }
    saved = json.loads(out.read_text())
    assert saved["passed"] is False and "no kernel today" in saved["rows"][0]["error"]
    assert any(r.get("tokens_per_s") == 12.5 for r in saved["rows"])
    table = format_check(report)
    assert "RuntimeError: no kernel today" in table and table.endswith("NOT ALL PASSED")


def test_a_host_synchronisation_inside_a_step_fails_the_host_sync_part(tmp_path, monkeypatch):
    from batchjob.model.llama import LlamaModel

    logits = LlamaModel.compute_logits

    def reads_a_value(self, hidden):
        out = logits(self, hidden)
        out.max().item()  # what a stray `.item()` in a step would do: wait for the device
        return out

    monkeypatch.setattr(LlamaModel, "compute_logits", reads_a_value)
    check = Check("cpu", str(tmp_path / "check.json"))
    check.host_sync(deadline=float("inf"))
    [row] = check.rows
    assert row["ok"] is False and row["error"].startswith("HostSync: aten._local_scalar_dense") and row["steps"] == 0
