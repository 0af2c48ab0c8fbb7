"""The Engine's Python API used as a careless or hostile caller would: lengths far past the context, calls cut short by
an exception, mismatched arguments, and requests the engine must refuse, each alone while the others complete."""

from __future__ import annotations

import pytest

from batchjob.engine.engine import Engine
from batchjob.engine.outputs import Request
from batchjob.engine.sampling_params import SamplingParams
from batchjob.engine.sequence import Sequence

MODEL = "smollm2-135m-instruct"
CONTEXT = 64  # a short context keeps a request that runs to it cheap
HUGE = (10**13, 2**63 - 1, 2**70)


@pytest.fixture(scope="module")
def engine():
    return Engine(MODEL, max_model_len=CONTEXT, max_num_seqs=4)


@pytest.fixture(scope="module")
def tiny_pool():
    """4 blocks of 16 tokens: less than one request that runs to the context of 128 needs."""
    return Engine(MODEL, max_model_len=128, num_kv_blocks=4, max_num_seqs=4)


def assert_idle(engine: Engine) -> None:
    """Nothing left queued or running, every KV block back in the pool."""
    assert not engine.scheduler.has_work()
    assert engine.block_manager.num_free_blocks == engine.num_kv_blocks


def ids(engine: Engine, text: str) -> list[int]:
    return engine.tokenizer.encode(text)


@pytest.mark.parametrize("huge", HUGE)
def test_a_huge_max_tokens_runs_to_the_context_and_the_others_go_on(engine, huge):
    prompt, other = ids(engine, "Count: one two three"), ids(engine, "Name a colour.")
    outs = engine.generate(
        [prompt, other],
        [SamplingParams(max_tokens=huge, ignore_eos=True), SamplingParams(max_tokens=4, ignore_eos=True)],
        use_tqdm=False,
    )
    assert outs[0].error is None and outs[0].finish_reason == "length"
    assert len(prompt) + len(outs[0].token_ids) == CONTEXT
    assert outs[1].finish_reason == "length" and len(outs[1].token_ids) == 4
    assert_idle(engine)
    [again] = engine.generate([other], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert again.token_ids == outs[1].token_ids  # the engine works on


def test_a_huge_max_tokens_that_cannot_fit_the_pool_fails_alone(tiny_pool):
    prompt = ids(tiny_pool, "Name a colour.")
    outs = tiny_pool.generate(
        [prompt, prompt],
        [SamplingParams(max_tokens=10**13), SamplingParams(max_tokens=4, ignore_eos=True)],
        use_tqdm=False,
    )
    assert outs[0].finish_reason == "error"
    assert outs[0].error == (
        f"prompt of {len(prompt)} tokens plus max_tokens {10**13} ({128 - len(prompt)} within the context) needs "
        "more KV blocks (8) than the pool's 4"
    )
    assert outs[1].error is None and len(outs[1].token_ids) == 4
    assert_idle(tiny_pool)


def test_a_request_that_needs_more_kv_blocks_than_the_pool_fails_alone(tiny_pool):
    prompt = ids(tiny_pool, "Name a colour.")
    outs = tiny_pool.generate(
        [prompt, prompt],
        [SamplingParams(max_tokens=100), SamplingParams(max_tokens=4, ignore_eos=True)],
        use_tqdm=False,
    )
    blocks = -(-(len(prompt) + 100) // 16)
    assert blocks > 4
    assert outs[0].finish_reason == "error"
    assert (
        outs[0].error
        == f"prompt of {len(prompt)} tokens plus max_tokens 100 needs more KV blocks ({blocks}) than the pool's 4"
    )
    assert outs[1].error is None and len(outs[1].token_ids) == 4


def test_prompts_at_the_edge_of_the_context(engine):
    """A prompt one token short of the context gets exactly one token; one as long as the context fails alone."""
    short, full = [ids(engine, "word")[0]] * (CONTEXT - 1), [ids(engine, "word")[0]] * CONTEXT
    outs = engine.generate([short, full, [], ids(engine, "Hi")], SamplingParams(max_tokens=10**13), use_tqdm=False)
    assert outs[0].error is None and outs[0].finish_reason == "length" and len(outs[0].token_ids) == 1
    assert outs[1].error == f"prompt has {CONTEXT} tokens; the model's context is {CONTEXT}"
    assert outs[2].error == "empty prompt"
    assert outs[3].error is None and outs[3].token_ids
    assert_idle(engine)


def test_a_one_token_prompt_with_max_tokens_0_is_answered_without_a_step(engine):
    """Seen: a one-token prompt asking only for its prompt logprobs (max_tokens 0) came back as an error ("nothing to
    score"). Its answer needs no model: the first token has no logprob, and no token is drawn. It comes back so,
    with the finish reason of any max_tokens 0 request, and no step is run for it."""
    one, two = [ids(engine, "word")[0]], ids(engine, "word word")[:2]
    params = SamplingParams(max_tokens=0, prompt_logprobs=2)
    steps = engine.step_count
    (out,) = engine.generate([one], params, use_tqdm=False)
    assert engine.step_count == steps
    assert out.error is None and out.prompt_logprobs == [None] and out.token_ids == [] and out.text == ""
    assert [s.token_ids for s in out.outputs] == [[]]
    outs = engine.generate([two, one], params, use_tqdm=False)
    assert outs[0].error is None and outs[0].prompt_logprobs[0] is None and outs[0].prompt_logprobs[1] is not None
    assert outs[1].prompt_logprobs == [None] and out.finish_reason == outs[1].finish_reason == outs[0].finish_reason
    assert_idle(engine)


def test_n_above_max_num_seqs_fails_alone(engine):
    prompt = ids(engine, "Name a colour.")
    outs = engine.generate(
        [prompt, prompt],
        [SamplingParams(n=5, temperature=1.0, max_tokens=4), SamplingParams(n=2, temperature=1.0, max_tokens=4)],
        use_tqdm=False,
    )
    assert outs[0].finish_reason == "error" and outs[0].error == "n=5 samples exceed max_num_seqs 4"
    assert outs[1].error is None and [len(s.token_ids) > 0 for s in outs[1].outputs] == [True, True]
    assert_idle(engine)


def test_n_samples_that_outgrow_a_small_pool_are_preempted_and_all_finish(tiny_pool):
    steps = []
    tiny_pool.add_step_callback(steps.append)
    try:
        [out] = tiny_pool.generate(
            [ids(tiny_pool, "Name a colour.")],
            SamplingParams(n=3, temperature=0.8, seed=1, max_tokens=20, ignore_eos=True),
            use_tqdm=False,
        )
    finally:
        tiny_pool.remove_step_callback(steps.append)
    assert sum(s.num_preemptions for s in steps) > 0  # 3 samples of 2 blocks each in a pool of 4
    assert [(len(s.token_ids), s.finish_reason) for s in out.outputs] == [(20, "length")] * 3
    assert_idle(tiny_pool)


@pytest.mark.parametrize("token", [-1, "vocab_size"])
def test_logit_bias_outside_the_vocabulary_fails_alone(engine, token):
    token = engine.model_config.vocab_size if token == "vocab_size" else token
    prompt = ids(engine, "Name a colour.")
    outs = engine.generate(
        [prompt, prompt],
        [SamplingParams(logit_bias={token: 5.0}), SamplingParams(max_tokens=3, ignore_eos=True)],
        use_tqdm=False,
    )
    assert outs[0].finish_reason == "error" and outs[0].error == "logit_bias holds token ids outside the vocabulary"
    assert outs[1].error is None and len(outs[1].token_ids) == 3
    assert_idle(engine)


def test_an_output_constraint_that_cannot_compile_fails_alone(engine):
    # model_copy skips validation, as a caller's code may: the engine still refuses the request, not the step.
    bad = SamplingParams(max_tokens=4).model_copy(update={"regex": "(["})
    prompt = ids(engine, "Name a colour.")
    outs = engine.generate([prompt, prompt], [bad, SamplingParams(max_tokens=3, ignore_eos=True)], use_tqdm=False)
    assert outs[0].finish_reason == "error" and outs[0].error.startswith("cannot compile the output constraint: ")
    assert "Regex parsing error" in outs[0].error
    assert outs[1].error is None and len(outs[1].token_ids) == 3
    assert_idle(engine)


class Interrupt(KeyboardInterrupt):
    """Ctrl-C, raised from a step callback a few steps into a call."""


def interrupt_after(engine: Engine, steps: int):
    first = engine.step_count

    def callback(metrics):
        if metrics.step - first >= steps:
            raise Interrupt

    return callback


def test_a_generate_cut_short_by_an_exception_leaves_nothing_behind(engine):
    questions = ["What is 2+2?", "Name a color."]
    params = SamplingParams(max_tokens=16)
    fresh = [o.token_ids for o in Engine(MODEL, max_model_len=CONTEXT).generate(questions, params, use_tqdm=False)]
    callback = interrupt_after(engine, 3)
    engine.add_step_callback(callback)
    try:
        with pytest.raises(Interrupt):
            engine.generate(
                ["Tell me a long story about the sea.", "Name a color."],
                SamplingParams(max_tokens=200, ignore_eos=True),
                use_tqdm=False,
            )
    finally:
        engine.remove_step_callback(callback)
    assert_idle(engine)
    outs = engine.generate(questions, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == fresh
    assert all(o.finish_reason in ("stop", "length") for o in outs)


def test_request_ids_are_unique_across_calls(engine):
    first = engine.generate(["Hi", "Yo"], SamplingParams(max_tokens=1), use_tqdm=False)
    second = engine.generate(["Hi", "Yo"], SamplingParams(max_tokens=1), use_tqdm=False)
    assert len({o.request_id for o in first + second}) == 4


def test_a_stream_closed_early_frees_its_requests(engine):
    prompt = ids(engine, "Name a colour.")
    stream = engine.stream(
        [Request("a", prompt, SamplingParams(max_tokens=1)), Request("b", prompt, SamplingParams(max_tokens=40))]
    )
    assert next(stream).request_id == "a"
    assert engine.scheduler.has_work()
    stream.close()
    assert_idle(engine)


def test_a_second_stream_while_one_runs_is_refused(engine):
    prompt = ids(engine, "Name a colour.")
    outer = engine.stream([Request("a", prompt, SamplingParams(max_tokens=1)), Request("b", prompt)])
    next(outer)
    with pytest.raises(RuntimeError, match="already running"):
        engine.generate(["Hi"], use_tqdm=False)
    rest = list(outer)  # the first stream is unharmed
    assert [o.request_id for o in rest] == ["b"] and rest[0].error is None
    assert_idle(engine)


def test_params_must_match_the_prompts_in_number(engine):
    with pytest.raises(ValueError, match="3 prompts but 1 sampling params"):
        engine.generate(["a", "b", "c"], [SamplingParams(max_tokens=1)], use_tqdm=False)
    with pytest.raises(ValueError, match="1 prompts but 0 sampling params"):
        engine.generate(["a"], [], use_tqdm=False)
    with pytest.raises(ValueError, match="1 prompts but 2 sampling params"):
        engine.generate(["a"], (SamplingParams(), SamplingParams()), use_tqdm=False)
    assert_idle(engine)
    outs = engine.generate(["a", "b", "c"], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [2, 2, 2]  # one SamplingParams applies to every prompt
    pair = engine.generate(
        ["a", "b"], (SamplingParams(max_tokens=1), SamplingParams(max_tokens=3, ignore_eos=True)), use_tqdm=False
    )
    assert [len(o.token_ids) for o in pair] == [1, 3]
    assert engine.generate([], use_tqdm=False) == []


def test_a_single_text_prompt_is_one_prompt(engine):
    [out] = engine.generate("What is 2+2?", SamplingParams(max_tokens=2), use_tqdm=False)
    assert out.prompt_token_ids == ids(engine, "What is 2+2?")


@pytest.mark.parametrize("prompt", [[1.5, 2], ["a", "b"], 7, None])
def test_a_prompt_of_the_wrong_type_raises_before_anything_runs(engine, prompt):
    before = engine.step_count
    with pytest.raises(TypeError, match="a prompt is a string or a list of token ids"):
        engine.generate(["Hi", prompt], SamplingParams(max_tokens=2), use_tqdm=False)
    assert engine.step_count == before
    assert_idle(engine)


def test_samples_keep_the_length_cap_of_their_request():
    """The n-1 samples forked from a request share its max_tokens as capped at admission (by the context, or by
    elastic compression), not the raw one they were asked with."""
    root = Sequence(Request("r", [1] * 5, SamplingParams(n=2, max_tokens=10**13)), 0)
    root.max_tokens, root.length_capped = 59, True
    child = root.fork(1)
    assert (child.max_tokens, child.length_capped, child.remaining_tokens) == (59, True, 59)
