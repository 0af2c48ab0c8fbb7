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


def test_a_sampled_token_s_logprob_is_its_own_not_the_argmax_s():
    """Rows whose token is not the raw argmax (drawn at a high temperature, or forced by a logit bias): each one's
    logprob is its own token's in the raw distribution, and the top list still starts at the argmax."""
    lg = logits(8)
    sampled = [SamplingParams(temperature=2.0, seed=s, logprobs=True, top_logprobs=2) for s in range(7)]
    forced = SamplingParams(logit_bias={7: 100.0}, logprobs=True, top_logprobs=2)  # greedy, on a biased row
    toks, lps = Sampler()(lg.clone(), seqs(*sampled, forced))
    raw, argmax = lg.log_softmax(-1), lg.argmax(-1).tolist()
    off = [i for i, (t, a) in enumerate(zip(toks, argmax)) if t != a]
    assert toks[7] == 7 != argmax[7] and len(off) >= 3, (toks, argmax)  # the case under test really occurs
    for i in off:
        assert lps[i].token_id == toks[i]
        assert lps[i].logprob == pytest.approx(raw[i, toks[i]].item()), i
        assert lps[i].logprob < raw[i, argmax[i]].item() and lps[i].top[0][0] == argmax[i], i


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
    engine.runner.execute = lambda sched, argmax=False, **kw: seen.append(argmax) or execute(sched, argmax, **kw)
    prompts = [[5, 9, 2, 7], [11, 3], [8] * 20]
    fast = engine.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True, n=2), use_tqdm=False)
    assert seen and all(seen)
    seen.clear()
    slow = engine.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True, n=2, logprobs=True), use_tqdm=False)
    assert seen and not any(seen)
    assert [[s.token_ids for s in o.samples] for o in fast] == [[s.token_ids for s in o.samples] for o in slow]


# --- the batched sampler against a row-at-a-time reference (the sampler as it was before it was batched) -----------
def reference_penalties(row: torch.Tensor, seq: Sequence) -> torch.Tensor:
    p = seq.params
    if p.logit_bias:
        row[torch.tensor(list(p.logit_bias))] += torch.tensor(list(p.logit_bias.values()), dtype=row.dtype)
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(seq.token_ids)))
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and seq.output_token_ids:
        ids, counts = torch.tensor(seq.output_token_ids).unique(return_counts=True)
        row[ids] -= p.frequency_penalty * counts.to(row.dtype) + p.presence_penalty
    return row


def reference_filter(row: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    if top_k and top_k < row.numel():
        row = row.masked_fill(row < row.topk(top_k).values[-1], float("-inf"))
    if top_p < 1.0 or min_p > 0.0:
        probs = row.softmax(-1)
        if min_p > 0.0:
            row = row.masked_fill(probs < min_p * probs.max(), float("-inf"))
        if top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            row = row.index_fill(0, order[(sorted_probs.cumsum(-1) - sorted_probs) >= top_p], float("-inf"))
    return row


MIXED = [
    SamplingParams(temperature=0.7, top_p=0.9, seed=1),
    SamplingParams(temperature=1.3, top_k=5, seed=2),
    SamplingParams(temperature=0.8, min_p=0.1, top_p=0.95, seed=3),
    SamplingParams(temperature=1.0, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2, seed=4),
    SamplingParams(temperature=0.9, logit_bias={3: 5.0, 7: -100.0}, top_k=20, top_p=0.8, seed=5),
    SamplingParams(temperature=0.0, repetition_penalty=1.5),  # greedy, penalized
    SamplingParams(temperature=1.0, top_k=1000, seed=6),  # k past the vocabulary: no filter
]


def mixed_seqs() -> list[Sequence]:
    out = seqs(*MIXED, prompt=(1, 2, 3, 3, 9))
    for i, seq in enumerate(out):
        for t in (4, 9, 9, 11 + i):
            seq.token_ids.append(t)
    return out


def test_batched_penalties_and_filters_equal_the_row_at_a_time_reference():
    from batchjob.engine.sampler import apply_penalties, filter_probs

    lg, ss = logits(len(MIXED), 64, seed=5), mixed_seqs()
    batched = lg.clone()
    apply_penalties(batched, ss)
    for i, seq in enumerate(ss):
        assert torch.allclose(batched[i], reference_penalties(lg[i].clone(), seq), atol=1e-6), i
    ps = [s.params for s in ss]
    scaled = batched / torch.tensor([max(p.temperature, 1.0) for p in ps]).unsqueeze(1)
    filtered = filter_probs(scaled, [p.top_k for p in ps], [p.top_p for p in ps], [p.min_p for p in ps])
    for i, p in enumerate(ps):
        expected = reference_filter(scaled[i], p.top_k, p.top_p, p.min_p).softmax(-1)
        assert torch.equal(filtered[i] > 0, expected > 0), i
        assert torch.allclose(filtered[i] / filtered[i].sum(), expected, atol=1e-6), i


def test_top_p_past_the_partial_sort_sorts_the_row_whole():
    from batchjob.engine.sampler import TOP_P_CANDIDATES, filter_probs

    flat = torch.randn(2, 4 * TOP_P_CANDIDATES, generator=torch.Generator().manual_seed(1)) * 0.01
    filtered = filter_probs(flat, [0, 0], [0.9, 0.2], [0.0, 0.0])
    for i, top_p in enumerate((0.9, 0.2)):
        expected = reference_filter(flat[i], 0, top_p, 0.0)
        assert torch.equal(filtered[i] > 0, ~expected.isinf()), i
    assert (filtered[0] > 0).sum() > TOP_P_CANDIDATES  # the candidates alone would have cut it short


def test_every_kind_of_row_samples_its_filtered_distribution_in_one_batch():
    """Many steps of one mixed batch: each row's token frequencies follow the softmax of its own penalized,
    temperature-scaled and filtered logits (the row-at-a-time reference)."""
    lg, ss = logits(len(MIXED), 24, seed=11), mixed_seqs()
    sampler, steps = Sampler(seed=3), 3000
    counts = torch.zeros(len(MIXED), 24)
    for _ in range(steps):
        tokens, _ = sampler(lg.clone(), ss)
        counts[torch.arange(len(MIXED)), torch.tensor(tokens)] += 1
    for i, seq in enumerate(ss):
        row, p = reference_penalties(lg[i].clone(), seq), seq.params
        if p.greedy:
            assert counts[i, row.argmax()] == steps
            continue
        expected = reference_filter(row / p.temperature, p.top_k, p.top_p, p.min_p).softmax(-1)
        assert torch.allclose(counts[i] / steps, expected, atol=0.03), (i, counts[i] / steps, expected)
        assert counts[i][expected == 0].sum() == 0, i  # a filtered-out token never comes out


def test_drawing_never_waits_for_the_device_and_the_host_reads_once():
    """Every kind of row but top-p (whose partial sort on a CPU asks which rows it missed; a GPU sorts whole) draws
    under the guard that raises where a GPU would make the host wait; the tokens and logprobs then come back in one
    read, equal to what the same draw gives through __call__."""
    from batchjob.engine.host_sync import forbid_host_sync

    kinds = [
        SamplingParams(),
        SamplingParams(logprobs=True, top_logprobs=3),
        SamplingParams(temperature=1.3, top_k=5, seed=2),
        SamplingParams(temperature=0.8, min_p=0.1, logprobs=True, seed=3),
        SamplingParams(temperature=1.0, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2, seed=4),
        SamplingParams(temperature=0.9, logit_bias={3: 5.0, 7: -100.0}, logprobs=True, top_logprobs=2),
        SamplingParams(temperature=0.0, repetition_penalty=1.5),
    ]

    def rows():
        return seqs(*kinds, prompt=(1, 2, 3, 3, 9))

    lg = logits(len(kinds), 64, seed=9)
    with forbid_host_sync(torch.device("cpu")):
        drawn = Sampler(seed=4).draw(lg.clone(), rows())
    tokens, logprobs = drawn.read(rows())
    assert (tokens, logprobs) == Sampler(seed=4)(lg.clone(), rows())
    assert [len(lp.top) if lp else None for lp in logprobs] == [None, 3, None, 0, None, 2, None]
    raw = lg.log_softmax(-1)
    assert logprobs[1].logprob == pytest.approx(raw[1, tokens[1]].item()) and tokens[1] == int(lg[1].argmax())
