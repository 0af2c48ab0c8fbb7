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
        ("kernels", "equality", "throughput", "graphs", "sampling", "host_sync", "kv_sizing", "real_model"), "passed"
    )
    rows = report["rows"]
    kernels = {r["check"].split()[0] for r in rows if r["part"] == "kernels"}
    assert kernels == {
        "rms_norm",
        "rotary",
        "silu_and_mul",
        "store_kv",
        "paged_attention",
        "varlen_attention",
        "fused_moe",
    }
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
    # the tiny model's dummy weights through an HF folder: the engine's Triton ops equal transformers in fp32
    [real] = [r for r in rows if r["part"] == "real_model"]
    assert real["check"].startswith("tiny-llama (dummy weights) float32") and real["ok"]
    assert real["sequences_equal"] == real["first_token_equal"] == "3/3" and real["prefix_share"] == 1.0
    assert real["engine_tokens_per_s"] > 0 and real["hf_tokens_per_s"] > 0
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
    monkeypatch.setattr(Check, "real_model", lambda self, deadline: None)
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
        "real_model": "passed",
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


def test_a_model_not_here_is_a_skipped_row_and_a_broken_one_a_failed_row(tmp_path, monkeypatch):
    """On a GPU's plan: the built-in models, neither installed nor cached, are skipped rows saying how to bring them
    (no pip run: download=False); a --model file that is no GGUF is its own failed row."""
    import importlib.util

    from batchjob.model import loader
    from batchjob.model.builtin import BUILTIN_MODELS

    monkeypatch.setenv("BATCHJOB_CACHE", str(tmp_path / "cache"))
    packages = {w.package for name in ("smollm2-135m-instruct", "gemma3-270m") for w in BUILTIN_MODELS[name].wheels}
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in packages else find_spec(name, *a))
    monkeypatch.setattr(loader.subprocess, "run", lambda *a, **k: pytest.fail(f"subprocess.run{a}"))
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"not a gguf")
    check = Check("cpu", None, small=False, models=(str(broken),))
    check.real_model(deadline=float("inf"))
    rows = {r["check"]: r for r in check.rows}
    assert rows.keys() == {"broken.gguf vs transformers", "smollm2-135m-instruct", "gemma3-270m"}
    assert rows["broken.gguf vs transformers"]["ok"] is False
    for name in ("smollm2-135m-instruct", "gemma3-270m"):
        assert rows[name]["ok"] is None and "--model PATH" in rows[name]["skipped"]
    assert "SKIP" in format_check({"device": {"device": "cpu", "torch": "x"}, "rows": check.rows, "parts": {}})


def test_real_model_fails_when_greedy_tokens_part_from_transformers(monkeypatch):
    """The tiny model's row, with transformers' last token of one sequence changed: not all equal, so it fails."""
    from batchjob.bench import systems

    hf_greedy = systems.hf_greedy

    def one_token_off(*args):
        out = hf_greedy(*args)
        out["0"] = out["0"][:-1] + [out["0"][-1] + 1]
        return out

    monkeypatch.setattr(systems, "hf_greedy", one_token_off)
    check = Check("cpu", None)
    check.real_model(deadline=float("inf"))
    [row] = check.rows
    assert row["ok"] is False and row["sequences_equal"] == "2/3" and row["first_token_equal"] == "3/3"
    assert 0.8 < row["prefix_share"] < 1
