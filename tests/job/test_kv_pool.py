"""The CPU KV pool a job gets: what its requests need at once (job/kv_pool.py), within the default pool; a setting
wins; the engine's results and preemptions as with the default pool."""

import json
from types import SimpleNamespace

import pyarrow.parquet as pq

import batchjob.engine.model_runner
from batchjob.engine.config import EngineConfig
from batchjob.engine.engine import Engine, SamplingParams
from batchjob.job.exit_codes import EXIT_OK
from batchjob.job.input.planner import Work
from batchjob.job.kv_pool import PoolNeed, job_pool_blocks
from batchjob.job.run.runner import run_job
from batchjob.job.spec import JobSpec
from tests.helpers import short_documents, summarize_prompts


def blocks(tokens: int, block_size: int = 16) -> int:
    return -(-tokens // block_size)


def test_the_pool_holds_the_largest_sequences_the_scheduler_runs_at_once():
    need = PoolNeed(max_num_seqs=2, block_size=4, watermark=1.0, cache_blocks=100)
    for i, (prompt, max_tokens) in enumerate([(3, 1), (17, 3), (9, 2), (1, 1)]):  # 1, 5, 3 and 1 blocks
        need.add([i] * prompt, max_tokens, n=1)  # sharing no prefix
    assert need.blocks == 5 + 3
    need.add([5] * 6, 2, n=3)  # three samples of 2 blocks: as many sequences, none among the two largest
    assert need.blocks == 8
    need.add([6] * 20, 4, n=3)  # three samples of 6 blocks, two of which the scheduler runs at once
    assert need.blocks == 12


def test_the_pool_keeps_room_under_the_watermark_and_for_the_prefixes_later_requests_read():
    need = PoolNeed(max_num_seqs=1, block_size=4, watermark=0.5, cache_blocks=100)
    need.add(list(range(12)), 4, n=1)  # 4 blocks
    assert need.blocks == 8
    need.add(list(range(8)) + [99] * 4, 4, n=1)  # its first two blocks are the first request's
    assert need.blocks == (4 + 2) * 2


def test_a_job_needing_the_whole_default_pool_keeps_it_without_reading_on():
    config = EngineConfig(max_num_seqs=4, block_size=16, kv_watermark=1.0)
    engine = SimpleNamespace(config=config, num_kv_blocks=10, max_model_len=4096)
    params = SamplingParams(max_tokens=16)

    def works():
        yield Work("0", [1] * 32, params, False)
        yield Work("1", [2] * 200, params, False)  # 14 blocks: more than the pool, whose limit it keeps
        raise AssertionError("read past the request that needs the whole pool")

    assert job_pool_blocks(engine, works()) == 10
    assert job_pool_blocks(engine, iter([Work("0", [1] * 32, params, False)])) == 3


def test_engine_fit_kv_pool_shrinks_only_the_default_pool_before_any_step():
    engine = Engine("smollm2-135m-instruct", dtype="float32", max_num_seqs=4)
    assert engine.kv_pool_sized_by == "default" and engine.num_kv_blocks > 64
    assert engine.fit_kv_pool(64) and (engine.num_kv_blocks, engine.kv_pool_sized_by) == (64, "job")
    assert engine.runner.kv_caches[0][0].shape[0] == 65  # with the block padded decode rows use
    assert engine.block_manager.num_blocks == 64
    ok, too_long = engine.generate([[1] * 40, [1] * 1100], SamplingParams(max_tokens=4), use_tqdm=False)
    assert ok.finish_reason == "length" and len(ok.token_ids) == 4
    # a request the pool cannot hold fails as with any pool
    assert too_long.finish_reason == "error" and "needs more KV blocks (69) than the pool's 64" in too_long.error
    assert not engine.fit_kv_pool(32) and engine.num_kv_blocks == 64  # the pool is in use now
    for setting in ({"num_kv_blocks": 100}, {"kv_cache_memory_gb": 0.05}):
        set_pool = Engine("smollm2-135m-instruct", dtype="float32", **setting)
        blocks_before = set_pool.num_kv_blocks
        assert set_pool.kv_pool_sized_by == next(iter(setting)) and not set_pool.fit_kv_pool(10)
        assert set_pool.num_kv_blocks == blocks_before


def test_the_default_pool_is_at_most_half_the_memory_available(monkeypatch):
    monkeypatch.setattr(batchjob.engine.model_runner, "available_memory", lambda: 2**28)
    engine = Engine("smollm2-135m-instruct", dtype="float32")
    assert engine.num_kv_blocks == 2**27 // (engine.config.block_size * engine.kv_bytes_per_token)


def test_a_job_sized_pool_preempts_no_more_and_computes_the_same(engine):
    """Long prompts and four sequences at once: the pool of the four largest sequences, against the default."""
    prompts = summarize_prompts(engine.tokenizer)
    params = SamplingParams(max_tokens=24, temperature=0.0)
    need = PoolNeed(4, 16, 0.95, 10_000)
    for p in prompts:
        need.add(p, 24, n=1)
    runs = {}
    for pool in (need.blocks, need.blocks // 2):  # the second must wait or preempt: the pool matters here
        sized = Engine("smollm2-135m-instruct", dtype="float32", max_num_seqs=4)
        assert sized.fit_kv_pool(pool)
        steps = []
        sized.add_step_callback(steps.append)
        outputs = sized.generate(prompts, params, use_tqdm=False)
        runs[pool] = ([o.token_ids for o in outputs], sum(s.num_preemptions for s in steps), len(steps))
    default = Engine("smollm2-135m-instruct", dtype="float32", max_num_seqs=4)
    steps = []
    default.add_step_callback(steps.append)
    expected = [o.token_ids for o in default.generate(prompts, params, use_tqdm=False)]
    tokens, preemptions, num_steps = runs[need.blocks]
    assert tokens == expected and preemptions == 0 == sum(s.num_preemptions for s in steps)
    assert num_steps == len(steps)  # the same schedule: no step waited for blocks
    smaller = runs[need.blocks // 2]
    assert smaller[1] > 0 or smaller[2] > num_steps, "a workload the pool's size does not touch"


def job(tmp_path, rows: int, words: int, **engine) -> JobSpec:
    return JobSpec.model_validate(
        {
            "model": "smollm2-135m-instruct",
            "input": {"path": str(short_documents(tmp_path, rows, words)), "id_column": "id"},
            "prompt": {"template": "Summarize: {text}", "chat_template": True},
            "sampling": {"max_tokens": 8, "temperature": 0.0},
            "engine": {"dtype": "float32", **engine},
            "output": {"path": str(tmp_path / "out")},
        }
    )


def summary(tmp_path) -> dict:
    return json.loads((tmp_path / "out" / "_summary.json").read_text())["this_run"]


def test_a_small_job_gets_the_pool_its_rows_need(tmp_path, progress, engine):
    spec = job(tmp_path, 6, 60)
    assert run_job(spec, progress) == EXIT_OK
    run = summary(tmp_path)
    assert run["kv_pool_sized_by"] == "sized from the job's requests" and run["preemptions"] == 0
    # every row at once (6 <= max_num_seqs), each its prompt and 8 tokens whole, under the 0.95 watermark
    table = pq.read_table(tmp_path / "out" / "data")
    need = sum(blocks(p + 8) for p in table.column("prompt_tokens").to_pylist())
    # and the blocks later rows read from the prefix cache (the chat template's head): at most the shortest prompt
    shortest = min(table.column("prompt_tokens").to_pylist())
    assert -(-need * 100 // 95) <= run["kv_pool_blocks"] <= -(-(need + shortest // 16) * 100 // 95)
    assert run["kv_pool_bytes"] == run["kv_pool_blocks"] * 16 * engine.kv_bytes_per_token


def test_a_setting_sizes_the_pool_of_a_job(tmp_path, progress):
    assert run_job(job(tmp_path, 3, 20, num_kv_blocks=300), progress) == EXIT_OK
    run = summary(tmp_path)
    assert (run["kv_pool_blocks"], run["kv_pool_sized_by"]) == (300, "engine.num_kv_blocks")


def test_a_row_longer_than_the_default_pool_fails_alone(tmp_path, progress, monkeypatch, engine):
    """The job's pool never exceeds the default's: a row that needs more gets its error row, the others run."""
    forty_blocks = 40 * 16 * engine.kv_bytes_per_token / 2**30
    monkeypatch.setattr(batchjob.engine.model_runner, "DEFAULT_CPU_KV_GB", forty_blocks)
    spec = job(tmp_path, 4, 600)  # the sample documents' first 600 words: 268 to 745 prompt tokens
    assert run_job(spec, progress) == EXIT_OK  # fail_on_row_errors is off
    table = pq.read_table(tmp_path / "out" / "data").to_pylist()
    failed = [r for r in table if r["error"]]
    assert failed and len(failed) < len(table) and all("needs more KV blocks" in r["error"] for r in failed)
    assert all(blocks(r["prompt_tokens"] + 8) > 40 for r in failed)
    assert summary(tmp_path)["kv_pool_blocks"] == 40
