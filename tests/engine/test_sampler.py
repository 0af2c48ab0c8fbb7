from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from batchjob.engine.config import EngineConfig
from batchjob.engine.outputs import Request
from batchjob.engine.sampler import Sampler, takes_argmax
from batchjob.engine.sampling_params import SamplingParams
from batchjob.engine.sequence import Sequence


def seqs(*params, prompt=(1, 2, 3)):
    return [Sequence(Request(str(i), list(prompt), p), i) for i, p in enumerate(params)]


def logits(n=4, v=50, seed=0):
    return torch.randn(n, v, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_and_logprobs_are_of_the_chosen_token():
    lg = logits(2)
    toks, lps = Sampler()(lg.clone(), seqs(SamplingParams(logprobs=True), SamplingParams()))
    assert toks == lg.argmax(-1).tolist()
    assert lps[0].logprob == pytest.approx(lg.log_softmax(-1)[0, toks[0]].item())
    assert lps[1] is None


def test_top_k_1_and_tiny_top_p_and_high_min_p_are_greedy():
    lg = logits(3)
    ps = [
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=1.0, top_p=1e-6),
        SamplingParams(temperature=1.0, min_p=1.0),
    ]
    toks, _ = Sampler()(lg.clone(), seqs(*ps))
    assert toks == lg.argmax(-1).tolist()


def test_seeded_rows_do_not_depend_on_the_batch():
    lg = logits(4)
    p = SamplingParams(temperature=1.0, seed=7)
    alone = [Sampler(seed=1)(lg[2:3].clone(), seqs(p))[0][0] for _ in range(2)]
    s_batch = seqs(SamplingParams(temperature=1.0), SamplingParams(temperature=0.5), p, SamplingParams())
    batched = Sampler(seed=2)(lg.clone(), s_batch)[0][2]
    assert alone[0] == alone[1] == batched


def test_sampling_follows_the_distribution():
    lg = torch.tensor([[0.0, 1.0, 2.0, -1.0]])
    s = seqs(SamplingParams(temperature=1.0, seed=3))[0]
    counts = torch.zeros(4)
    sampler = Sampler()
    for _ in range(4000):
        counts[sampler(lg.clone(), [s])[0][0]] += 1
    assert torch.allclose(counts / 4000, lg.softmax(-1)[0], atol=0.03)


def test_penalties_move_away_from_seen_tokens():
    lg = torch.zeros(1, 10)
    lg[0, 5] = 2.0
    lg[0, 6] = 1.9
    s = seqs(SamplingParams(repetition_penalty=1.5), prompt=(5,))[0]
    assert Sampler()(lg.clone(), [s])[0] == [6]
    s = seqs(SamplingParams(frequency_penalty=0.5), prompt=(1,))[0]
    s.token_ids.append(5)  # an output token
    assert Sampler()(lg.clone(), [s])[0] == [6]
    s = seqs(SamplingParams(presence_penalty=0.5), prompt=(5,))[0]  # prompt tokens are not penalised
    assert Sampler()(lg.clone(), [s])[0] == [5]


@pytest.mark.parametrize(
    "bad, field",
    [
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"kv_watermark": 1.5}, "kv_watermark"),
        ({"profile": "fast"}, "profile"),
        ({"max_num_batched_tokns": 8}, "max_num_batched_tokns"),
        ({"kv_cache_dtype": "int4"}, "kv_cache_dtype"),
    ],
)
def test_bad_engine_config_names_the_field(bad, field):
    with pytest.raises(ValidationError, match=field):
        EngineConfig(**bad)


def test_profiles_fill_unset_fields_only():
    assert EngineConfig(profile="latency").kv_watermark < EngineConfig().kv_watermark
    assert EngineConfig(profile="latency", max_num_seqs=7).max_num_seqs == 7


def test_bad_sampling_params_name_the_field():
    with pytest.raises(ValidationError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValidationError, match="stop"):
        SamplingParams(stop=[""])


def test_non_finite_and_vanishing_temperatures():
    with pytest.raises(ValueError, match="finite number"):
        SamplingParams(temperature=float("inf"))
    [seq] = seqs(SamplingParams(temperature=1e-300, top_p=0.5))
    assert seq.params.greedy and Sampler()(torch.tensor([[1.0, 3.0, 2.0]]), [seq])[0] == [1]


def test_which_rows_take_the_argmax_on_the_device():
    plain, hot, logprobs, penalty, bias, constrained = seqs(
        SamplingParams(),
        SamplingParams(temperature=0.7),
        SamplingParams(logprobs=True),
        SamplingParams(repetition_penalty=1.2),
        SamplingParams(logit_bias={3: 2.0}),
        SamplingParams(),
    )
    constrained.matcher = object()  # any grammar matcher: the row's logits are masked on the host
    assert takes_argmax(plain)
    assert not any(map(takes_argmax, (hot, logprobs, penalty, bias, constrained)))


def test_a_greedy_step_reads_tokens_not_logits_and_keeps_the_sampler_s_tokens():
    """Plain greedy steps take their argmax on the device (the runner returns one id a row); the same prompts with
    logprobs go through the host sampler: the same tokens, n > 1 samples included."""
    from batchjob.engine.engine import Engine

    engine = Engine("tiny-llama", load_format="dummy", device="cpu", num_kv_blocks=64, max_model_len=128)
    seen = []
    execute = engine.runner.execute
    engine.runner.execute = lambda sched, argmax=False: seen.append(argmax) or execute(sched, argmax)
    prompts = [[5, 9, 2, 7], [11, 3], [8] * 20]
    fast = engine.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True, n=2), use_tqdm=False)
    assert seen and all(seen)
    seen.clear()
    slow = engine.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True, n=2, logprobs=True), use_tqdm=False)
    assert seen and not any(seen)
    assert [[s.token_ids for s in o.samples] for o in fast] == [[s.token_ids for s in o.samples] for o in slow]
