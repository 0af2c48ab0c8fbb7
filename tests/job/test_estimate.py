from batchjob.job.plan import PrefixCacheModel, plan_job
from tests.helpers import fake_factory, make_job, write_jsonl


def test_plan_counts_tokens_sharing_duplicates_and_fit(tmp_path):
    rows = [{"id": f"r{i}", "text": f"document number {i % 6} " * (1 + i % 6)} for i in range(12)]
    rows.append({"id": "bad", "text": None})
    job = make_job(
        write_jsonl(tmp_path / "d.jsonl", rows),
        tmp_path / "out",
        prompt={"system": "A shared system prompt, long enough to fill two blocks."},
        sampling={"max_tokens": 10},
    )
    plan = plan_job(job, engine_factory=fake_factory(max_num_seqs=4))
    assert plan["rows"] == 13 and plan["rows_failing_before_the_model"] == 1
    assert plan["requests"] == 6 and plan["duplicate_rows_computed_once"] == 6
    assert plan["prompt_tokens_p50"] <= plan["prompt_tokens_p99"] <= plan["prompt_tokens_total"]
    assert plan["output_tokens_max"] == 60 and 0 < plan["output_tokens_expected"] <= 60
    assert 0.3 < plan["prefix_sharing_ratio"] < 1  # every prompt after the first reuses the system prompt's blocks
    assert plan["kv_cache_tokens"] == 256 * 16 and plan["sequences_that_fit"] > 0 and plan["max_num_seqs"] == 4
    assert plan["calibration"]["requests"] == 6 and plan["estimated_time_s"] >= 0
    assert not (tmp_path / "out").exists()
    assert "calibration" not in plan_job(job, calibrate=False, engine_factory=fake_factory())


def test_the_prefix_cache_model_hits_whole_shared_blocks_and_forgets_the_oldest():
    cache = PrefixCacheModel(num_blocks=3, block_size=2)
    assert cache.hit_tokens([1, 2, 3, 4, 5]) == 0
    assert cache.hit_tokens([1, 2, 3, 9]) == 2  # the first block is shared, the second differs
    assert cache.hit_tokens([7, 7, 8, 8]) == 0  # evicts the oldest blocks
    assert cache.hit_tokens([1, 2, 3, 4]) == 0


def test_plan_counts_constrained_rows_and_distinct_grammars(tmp_path):
    def line(i: int, **body) -> dict:
        messages = [{"role": "user", "content": f"question {i}"}]
        return {
            "custom_id": f"q{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"messages": messages, **body},
        }

    schema = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}}
    lines = [
        line(0, response_format=schema),
        line(1, response_format=schema),
        line(2, response_format={"type": "json_object"}),
    ]
    lines.append(line(3))
    job = make_job(write_jsonl(tmp_path / "b.jsonl", lines), tmp_path / "out", input={"format": "openai-batch"})
    plan = plan_job(job, calibrate=False, engine_factory=fake_factory())
    assert plan["constrained_rows"] == 3 and plan["distinct_grammars"] == 2
