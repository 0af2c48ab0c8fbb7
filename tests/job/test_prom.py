"""metrics.prom: valid Prometheus text, the vLLM-style names, values that agree with _summary.json."""

import json

import pyarrow.compute as pc
import pyarrow.parquet as pq
from prometheus_client.parser import text_string_to_metric_families

from batchjob.job.exit_codes import EXIT_OK
from batchjob.job.output.state import METRICS, TIMELINE
from batchjob.job.runner import run_job
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
    assert run_job(job, progress, engine_factory=fake_factory()) == EXIT_OK
    summary = json.loads((out / "_summary.json").read_text())
    samples = parse(out / METRICS)
    assert samples["batchjob_prompt_tokens_total"].value == summary["prompt_tokens"] > 0
    assert samples["batchjob_generation_tokens_total"].value == summary["output_tokens"] > 0
    assert samples["batchjob_rows_failed_total"].value == summary["rows_failed"] == 1
    assert samples["batchjob_rows_done_total"].value == samples["batchjob_rows"].value == summary["rows_total"]
    assert samples["batchjob_num_preemptions_total"].value == summary["this_run"]["preemptions"]
    assert samples["batchjob_last_success_timestamp_seconds"].value == (out / "_SUCCESS").stat().st_mtime
    assert samples["batchjob_last_run_exit_code"].value == 0
    timeline = pq.read_table(out / TIMELINE)
    assert samples["batchjob_kv_cache_usage_perc"].value == pc.mean(timeline.column("kv_cache_usage")).as_py() == 0.5
    assert samples["batchjob_prompt_tokens_total"].labels == {"model_name": "fake", "output": str(out.resolve())}


def test_an_interrupted_run_reports_its_exit_code_and_no_success(tmp_path, progress):
    out = tmp_path / "out"
    job = make_job(write_parquet(tmp_path / "docs.parquet", documents(12)), out, output={"checkpoint_rows": 1})
    assert run_job(job, progress, engine_factory=fake_factory(signal_at=(3,))) == 143
    samples = parse(out / METRICS)
    assert samples["batchjob_last_run_exit_code"].value == 143
    assert samples["batchjob_last_success_timestamp_seconds"].value == 0
    assert 3 <= samples["batchjob_rows_done_total"].value < samples["batchjob_rows"].value == 12
