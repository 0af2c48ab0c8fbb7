import pytest

from batchjob.job.kv_pool import PrefixCacheModel
from batchjob.job.plan import plan_job
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
    assert plan["calibration"]["requests"] == 6 and plan["calibration"]["decode_step_s"] > 0
    assert not (tmp_path / "out").exists()
    assert "calibration" not in plan_job(job, calibrate=False, engine_factory=fake_factory())


def test_the_estimate_grows_with_the_rows_and_the_tokens_to_generate(tmp_path):
    """Decode-bound work (the fake reports no prefill): the estimate is generated tokens over the run's concurrency
    times the measured step, so twice the requests or twice max_tokens (every answer is cut by it) is twice the time.
    The e2e plan test compares an estimate with a measured run on the real model."""
    long_text = " ".join(f"word{k}" for k in range(40))  # answers of ~300 bytes: cut at any max_tokens used here

    def estimate(rows: int, max_tokens: int) -> float:
        data = [{"id": f"r{i}", "text": f"{i} {long_text}"} for i in range(rows)]
        job = make_job(
            write_jsonl(tmp_path / f"d{rows}.jsonl", data), tmp_path / "out", sampling={"max_tokens": max_tokens}
        )
        factory = fake_factory(max_num_seqs=4, step_metrics=lambda step: {"step_time": 0.05})
        plan = plan_job(job, engine_factory=factory)
        assert plan["calibration"]["decode_step_s"] == 0.05 and plan["output_tokens_expected"] == rows * max_tokens
        return plan["estimated_time_s"]

    base = estimate(8, 20)
    assert base == pytest.approx(8 * 20 / 4 * 0.05, abs=0.1)  # 40 decode steps of four sequences, 0.05 s each
    assert estimate(16, 20) == pytest.approx(2 * base, abs=0.1)
    assert estimate(8, 40) == pytest.approx(2 * base, abs=0.1)
    assert estimate(2, 20) == pytest.approx(20 * 0.05, abs=0.1)  # two sequences, both at once: 20 steps


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


def test_plan_of_a_qwen3_moe_counts_kv_by_its_head_dim(tmp_path):
    """Qwen3's head_dim is its own (64 here, where hidden / heads is 16): the KV a sequence takes is layers x K and V x
    KV heads x head_dim x 4 bytes (fp32) a token. The model is the config alone (load_format dummy)."""
    import json

    config = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "max_position_embeddings": 512,
    }
    (tmp_path / "qwen3moe.json").write_text(json.dumps(config))
    rows = [{"id": f"r{i}", "text": "some words " * (3 + i)} for i in range(4)]
    job = make_job(
        write_jsonl(tmp_path / "d.jsonl", rows),
        tmp_path / "out",
        model=str(tmp_path / "qwen3moe.json"),
        prompt={"chat_template": False},
        sampling={"max_tokens": 4},
        engine={"load_format": "dummy", "dtype": "float32", "device": "cpu", "num_kv_blocks": 64, "num_threads": 1},
    )
    plan = plan_job(job, calibrate=False)
    per_token = 3 * 2 * 2 * 64 * 4
    tokens = plan["prompt_tokens_total"] / 4 + plan["output_tokens_expected"] / 4
    assert plan["kv_bytes_per_sequence_mean"] == round(per_token * tokens)
    assert plan["kv_bytes_per_sequence_max"] == per_token * (plan["prompt_tokens_p99"] + 4)


@pytest.mark.parametrize("task", ["generate", "score"])
def test_plan_counts_the_rows_of_each_lora_adapter(tmp_path, task):
    """engine.lora: the plan says how many rows each adapter and the base model will run (identical rows of one
    adapter computed once still count each); a row naming an unknown adapter fails before the model."""
    cells = ["a", "b", None, "a", "", "a", "nope"]
    rows = [{"id": f"r{i}", "text": f"row {i % 4}", "lora": c} for i, c in enumerate(cells)]
    sections = {"engine": {"lora": {"adapters": {"a": "folder-a", "b": "folder-b"}}}}
    if task == "score":
        sections |= {"task": "score", "sampling": None, "score": {"labels": [" yes", " no"]}}
    job = make_job(write_jsonl(tmp_path / "d.jsonl", rows), tmp_path / "out", **sections)
    plan = plan_job(job, calibrate=False, engine_factory=fake_factory())
    assert plan["rows_failing_before_the_model"] == 1
    assert plan["lora_rows"] == {"base_model": 2, "adapters": {"a": 3, "b": 1}}
    no_lora = make_job(tmp_path / "d.jsonl", tmp_path / "out", **{k: v for k, v in sections.items() if k != "engine"})
    assert "lora_rows" not in plan_job(no_lora, calibrate=False, engine_factory=fake_factory())
