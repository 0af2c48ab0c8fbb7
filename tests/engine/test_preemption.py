"""Preemption by recompute on the real SmolLM2 model (float32): a preempted request's output, its logprobs included,
is the one it gets without preemption, greedy and seeded sampled alike."""

from __future__ import annotations

import pytest

from batchjob.engine.engine import Engine
from batchjob.engine.sampling_params import SamplingParams
from tests.conftest import chat_messages

MAX_TOKENS = 40
TOPICS = ("the sea", "trains", "bread", "owls", "copper", "rain", "chess", "glass")


def params(i: int) -> SamplingParams:
    """Even rows greedy, odd rows sampled with their own seed; all with logprobs, none stopped early."""
    sampled = {"temperature": 0.8, "top_p": 0.95, "seed": 100 + i} if i % 2 else {}
    return SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=True, top_logprobs=2, **sampled)


@pytest.fixture(scope="module")
def requests(engine) -> tuple[list[list[int]], list[SamplingParams]]:
    prompts = [engine.tokenizer.encode_chat(chat_messages(f"Write about {t}.")) for t in TOPICS]
    return prompts, [params(i) for i in range(len(prompts))]


def test_a_preempted_request_keeps_its_tokens_and_logprobs(engine, requests):
    prompts, plist = requests
    # The session engine's pool holds them all: nothing is preempted (in float32 batching changes no output).
    unpreempted = engine.generate(prompts, plist, use_tqdm=False)
    assert all(o.metrics.num_preemptions == 0 for o in unpreempted)
    # 8 requests of about 30 + 40 tokens (5 blocks each at the end) in a pool of 16 blocks: decodes run out of blocks
    # and the newest running requests are preempted after they have drawn tokens, then computed again.
    small = Engine("smollm2-135m-instruct", dtype="float32", num_kv_blocks=16, kv_watermark=1.0)
    outs = small.generate(prompts, plist, use_tqdm=False)
    preempted = [i for i, o in enumerate(outs) if o.metrics.num_preemptions]
    assert {i % 2 for i in preempted} == {0, 1}, preempted  # greedy and sampled rows both went through it
    for i, (o, ref) in enumerate(zip(outs, unpreempted)):
        assert len(o.token_ids) == MAX_TOKENS and len(o.logprobs) == len(o.token_ids), (i, len(o.logprobs))
        assert o.token_ids == ref.token_ids, i
        assert [lp.token_id for lp in o.logprobs] == o.token_ids, i
        assert [lp.logprob for lp in o.logprobs] == pytest.approx([lp.logprob for lp in ref.logprobs], abs=1e-3), i
        assert o.text == ref.text, i
    assert small.block_manager.num_free_blocks == small.num_kv_blocks  # nothing leaked
