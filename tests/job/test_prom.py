"""metrics.prom: valid Prometheus text, the vLLM-style names, values that agree with _summary.json."""

import json

import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from prometheus_client.parser import text_string_to_metric_families

from batchjob.job.exit_codes import EXIT_OK
from batchjob.job.output.state import METRICS, TIMELINE
from batchjob.job.run.runner import run_job
from tests.helpers import documents, fake_factory, make_job, write_jsonl, write_parquet

NAMES = {
    "batchjob_kv_cache_usage_perc": "gauge",
    "batchjob_num_preemptions": "counter",
    "batchjob_prompt_tokens": "counter",
    "batchjob_generation_tokens": "counter",
    "batchjob_rows_failed": "counter",
    "batchjob_last_success_timestamp_seconds": "gauge",
}


def parse(path) -> dict:
    text = path.read_text()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name, kind in NAMES.items():
        exposed = f"{name}_total" if kind == "counter" else name
        assert f"# HELP {exposed} " in text and f"# TYPE {exposed} {kind}\n" in text
        assert families[name].type == kind
    return {s.name: s for f in families.values() for s in f.samples}


def test_a_finished_run_writes_metrics_that_agree_with_its_summary(tmp_path, progress):
    rows = documents(9) + [{"id": "bad", "title": "t", "source": "s", "text": None}]
    out = tmp_path / "out"
    job = make_job(write_jsonl(tmp_path / "docs.jsonl", rows), out)
    # Steps whose KV usage, duration and preemptions vary, so that the time-weighted mean, the plain mean, the
    # largest and the last KV usage all differ, as do the sum, the largest and the last count of preemptions.
    reported = []

    def step_metrics(step: int) -> dict:
        fields = {
            "kv_cache_usage": (0.2, 0.9, 0.4, 0.1, 0.3)[step % 5],
            "step_time": (0.001, 0.005, 0.002)[step % 3],
            "num_preemptions": (0, 3, 1, 0, 2)[step % 5],
        }
        reported.append(fields)
        return fields

    assert run_job(job, progress, engine_factory=fake_factory(step_metrics=step_metrics)) == EXIT_OK
    usage, seconds = [f["kv_cache_usage"] for f in reported], [f["step_time"] for f in reported]
    preempted = [f["num_preemptions"] for f in reported]
    weighted = sum(u * t for u, t in zip(usage, seconds)) / sum(seconds)
    assert len({round(weighted, 6), round(sum(usage) / len(usage), 6), max(usage), usage[-1]}) == 4
    assert len({sum(preempted), max(preempted), preempted[-1], len(preempted)}) == 4

    summary = json.loads((out / "_summary.json").read_text())
    samples = parse(out / METRICS)
    assert samples["batchjob_prompt_tokens_total"].value == summary["prompt_tokens"] > 0
    assert samples["batchjob_generation_tokens_total"].value == summary["output_tokens"] > 0
    assert samples["batchjob_rows_failed_total"].value == summary["rows_failed"] == 1
    assert samples["batchjob_rows_done_total"].value == samples["batchjob_rows"].value == summary["rows_total"]
    assert samples["batchjob_num_preemptions_total"].value == summary["this_run"]["preemptions"] == sum(preempted)
    assert samples["batchjob_last_success_timestamp_seconds"].value == (out / "_SUCCESS").stat().st_mtime
    assert samples["batchjob_last_run_exit_code"].value == 0
    # KV usage averaged over the engine's busy time (its help text's promise)
    assert samples["batchjob_kv_cache_usage_perc"].value == pytest.approx(weighted)
    timeline = pq.read_table(out / TIMELINE)
    assert pc.sum(timeline.column("preemptions")).as_py() == sum(preempted)
    assert pc.max(timeline.column("kv_cache_usage_max")).as_py() == max(usage)
    assert samples["batchjob_prompt_tokens_total"].labels == {"model_name": "fake", "output": str(out.resolve())}


def test_an_interrupted_run_reports_its_exit_code_and_no_success(tmp_path, progress):
    out = tmp_path / "out"
    job = make_job(write_parquet(tmp_path / "docs.parquet", documents(12)), out, output={"checkpoint_rows": 1})
    assert run_job(job, progress, engine_factory=fake_factory(signal_at=(3,))) == 143
    samples = parse(out / METRICS)
    assert samples["batchjob_last_run_exit_code"].value == 143
    assert samples["batchjob_last_success_timestamp_seconds"].value == 0
    assert 3 <= samples["batchjob_rows_done_total"].value < samples["batchjob_rows"].value == 12
