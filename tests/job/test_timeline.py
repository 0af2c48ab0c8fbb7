"""The run timeline: bounded rows on a long run with exact totals, written by every run, appended on resume."""

import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from batchjob.engine.outputs import StepMetrics
from batchjob.job.exit_codes import EXIT_OK
from batchjob.job.output.state import TIMELINE
from batchjob.job.run.runner import run_job
from batchjob.job.telemetry.timeline import SCHEMA, Timeline
from tests.helpers import documents, fake_factory, make_job, write_parquet


def step(k: int) -> StepMetrics:
    return StepMetrics(
        step=k,
        time=1000.0 + k,
        step_time=0.5,
        num_seqs=k % 7,
        num_prefill_tokens=k % 3,
        num_decode_tokens=k % 7,
        kv_cache_usage=(k % 10) / 10,
        num_preemptions=int(k % 50 == 0),
        prefix_cache_queries=k,
        prefix_cache_hits=k // 2,
        num_waiting=1,
        num_running=k % 7,
        token_budget=512,
    )


def total(table, column: str):
    return pc.sum(table.column(column)).as_py()


def test_a_long_run_keeps_between_half_and_all_of_max_rows_with_exact_totals(tmp_path):
    timeline = Timeline(tmp_path / TIMELINE, max_rows=64)
    n = 10_000
    for k in range(1, n + 1):
        timeline.add(step(k))
    timeline.write()
    table = pq.read_table(tmp_path / TIMELINE)
    assert table.schema == SCHEMA and 32 <= table.num_rows <= 64
    assert total(table, "steps") == n and table.column("step")[0].as_py() == 1
    assert total(table, "prefill_tokens") == sum(k % 3 for k in range(1, n + 1))
    assert total(table, "decode_tokens") == sum(k % 7 for k in range(1, n + 1))
    assert total(table, "preemptions") == n // 50 == timeline.preemptions
    assert total(table, "busy_s") == pytest.approx(0.5 * n)
    # Evenly spaced: every full row covers the same number of steps.
    assert len(set(table.column("steps").to_pylist()[:-1])) == 1
    assert table.column("num_seqs_max").to_pylist()[0] == 6 and table.column("time")[-1].as_py() == 1000.0 + n
    weighted = pc.sum(pc.multiply(table.column("kv_cache_usage"), table.column("steps"))).as_py() / n
    assert weighted == pytest.approx(sum((k % 10) / 10 for k in range(1, n + 1)) / n)
    assert timeline.kv_cache_usage_mean == pytest.approx(weighted)


def test_every_run_writes_its_timeline_and_a_resume_appends_to_it(tmp_path, progress):
    docs = write_parquet(tmp_path / "docs.parquet", documents(23))
    job = make_job(docs, tmp_path / "out")
    assert run_job(job, progress, engine_factory=fake_factory(steps_per_output=300, signal_at=(5,))) == 143
    first = pq.read_table(tmp_path / "out" / TIMELINE)
    assert first.num_rows and set(first.column("run").to_pylist()) == {0}
    assert run_job(job, progress, engine_factory=fake_factory(steps_per_output=300)) == EXIT_OK
    table = pq.read_table(tmp_path / "out" / TIMELINE)
    second = table.filter(pc.equal(table.column("run"), 1))
    assert table.num_rows == first.num_rows + second.num_rows
    # 300 steps for each row the second run computed: sampled down to at most MAX_ROWS rows.
    assert total(second, "steps") >= 300 * 10 and 1024 <= second.num_rows <= 2048
