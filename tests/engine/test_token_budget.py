"""The auto token budget against a synthetic machine: step time = overhead + per-token cost, growing faster than
linearly past a knee, with measurement noise and a slow drift in the machine's speed (other load on a shared host)."""

from __future__ import annotations

import math
import random

import pytest
from pydantic import ValidationError

from batchjob.engine.config import EngineConfig
from batchjob.engine.engine import Engine, SamplingParams
from batchjob.engine.token_budget import GAIN, REPROBE_SAMPLES, AutoTokenBudget, budget_cap
from batchjob.job.spec import JobFileError, load_job


def step_time(tokens: int, knee: int, overhead: float = 0.02, per_token: float = 5e-5) -> float:
    excess = max(0, tokens - knee)
    return overhead + per_token * tokens + per_token * excess**2 / knee


def best_level(levels: list[int], knee: int) -> int:
    """The smallest level whose next level up gains less than GAIN, on the noiseless model."""
    rate = {n: n / step_time(n, knee) for n in levels}
    for low, high in zip(levels, levels[1:]):
        if rate[high] < rate[low] * (1 + GAIN):
            return low
    return levels[-1]


def drive(tuner: AutoTokenBudget, knee: int, steps: int, seed: int = 0, noise: float = 0.03, drift: float = 0.3):
    rng = random.Random(seed)
    for k in range(steps):
        tokens = tuner.value
        slowdown = 1 + drift * math.sin(k / 7)  # the machine's speed changes over a few dozen steps
        tuner.observe(tokens, tokens, step_time(tokens, knee) * slowdown * rng.uniform(1 - noise, 1 + noise))


@pytest.mark.parametrize("knee", [256, 1024, 4096])
@pytest.mark.parametrize("start", [128, 2048, 16384])
def test_it_settles_at_the_knee_from_any_start(knee, start):
    tuner = AutoTokenBudget(16384, start=start)
    drive(tuner, knee, steps=200)
    assert tuner.settled
    assert tuner.chosen == best_level(tuner.levels, knee), tuner.summary()
    assert tuner.value == tuner.chosen


def test_the_expected_levels_are_at_the_knee_or_next_to_it():
    # Guards the test's model: the answer is at or next to the knee (a small knee still pays for one more doubling
    # by spreading the fixed overhead), not at an end of the ladder, and it is clear by more than the noise.
    levels = AutoTokenBudget(16384, start=128).levels
    assert [best_level(levels, k) for k in (256, 1024, 4096)] == [512, 1024, 4096]


def test_steps_that_do_not_fill_the_budget_or_carry_no_prefill_are_not_measured():
    tuner = AutoTokenBudget(16384, start=2048)
    for _ in range(100):
        tuner.observe(tuner.value // 2, tuner.value // 2, 0.1)  # short of work
        tuner.observe(tuner.value, 0, 0.1)  # decode only
    assert not tuner.settled and tuner.rates == {} and tuner.chosen == 2048


def test_it_follows_a_moving_knee_after_reprobing():
    tuner = AutoTokenBudget(16384, start=128)
    drive(tuner, 4096, steps=200)
    assert tuner.chosen == 4096
    drive(tuner, 256, steps=REPROBE_SAMPLES + 200, seed=1)
    assert tuner.settled and tuner.chosen == 512


def test_the_cap_bounds_the_ladder():
    assert budget_cap(256, 8192) == 16384
    assert budget_cap(4, 512) == 2048  # four whole contexts fill a step
    assert budget_cap(256, 8192, kv_pool_tokens=2048) == 512  # a quarter of a small pool
    assert AutoTokenBudget(budget_cap(256, 8192, 2048), start=2048).levels == [128, 256, 512]
    tiny = AutoTokenBudget(64, start=2048)
    assert tiny.levels == [64] and tiny.settled and tiny.value == 64


def test_config_takes_auto_or_a_number_and_names_the_field_otherwise(tmp_path):
    assert EngineConfig(max_num_batched_tokens="auto").max_num_batched_tokens == "auto"
    assert EngineConfig(max_num_batched_tokens="1024").max_num_batched_tokens == 1024
    assert EngineConfig().max_num_batched_tokens == 2048  # the profile's, when unset
    for bad in ("fast", "Auto", 8, 12.5, True):
        with pytest.raises(ValidationError, match=r"max_num_batched_tokens\n.*expected a whole number >= 16 or 'auto'"):
            EngineConfig(max_num_batched_tokens=bad)
    job = tmp_path / "job.yaml"
    job.write_text("input: {path: docs.parquet}\noutput: {path: out}\nengine: {max_num_batched_tokens: fast}\n")
    with pytest.raises(
        JobFileError,
        match=r"engine\.max_num_batched_tokens: expected a whole number >= 16 or "
        r"'auto' \(got 'fast'\)",
    ):
        load_job(job)
    assert load_job(job, ["engine.max_num_batched_tokens=auto"]).engine.max_num_batched_tokens == "auto"


def test_the_engine_tunes_within_its_cap_and_reports_each_step_budget():
    engine = Engine("smollm2-135m-instruct", max_num_batched_tokens="auto", num_kv_blocks=64)
    assert engine.budget_cap == 256 and engine.auto_budget.levels == [128, 256]  # a quarter of 64 blocks of 16
    steps = []
    engine.add_step_callback(steps.append)
    prompts = [[100 + i] * (40 + 30 * i) for i in range(6)]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    tuned = engine.generate(prompts, params)
    assert {s.token_budget for s in steps} == {128, 256}  # the two levels took turns
    assert all(s.num_prefill_tokens + s.num_decode_tokens <= s.token_budget for s in steps)
    assert engine.token_budget in (128, 256)
    engine.set_token_budget(64)
    assert engine.auto_budget is None and engine.token_budget == 64
    assert [o.token_ids for o in engine.generate(prompts, params)] == [o.token_ids for o in tuned]
