"""Prompt logprobs against transformers: float32 log_softmax of each position's logits, on the tiny model of every
family (tests/oracle/test_tiny_architectures.py builds them) and on the real default model, with prefills cut into
chunks of a small token budget."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the oracle needs the test extra")

from batchjob.engine.sampling_params import SamplingParams  # noqa: E402
from tests.oracle.test_tiny_architectures import CASES, PHI3_ORIGINAL_MAX, VOCAB, build, tiny_tokenizer  # noqa: E402

TOP = 3
TOL = 1e-4


@pytest.fixture(scope="module")
def tokenizer_json() -> str:
    return tiny_tokenizer().to_str()


def reference_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """transformers' float32 log_softmax at every position but the last: row p is the distribution of token p + 1."""
    with torch.inference_mode():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0, :-1].float(), -1)


def assert_prompt_logprobs_match(
    prompt_logprobs, ids: list[int], ref: torch.Tensor, start: int, label: str, tol: float = TOL
) -> None:
    assert prompt_logprobs[:start] == [None] * start, label
    assert len(prompt_logprobs) == len(ids), label
    for i in range(start, len(ids)):
        lp = prompt_logprobs[i]
        assert lp.token_id == ids[i], label
        diff = abs(lp.logprob - ref[i - 1, ids[i]].item())
        assert diff <= tol, f"{label}: token {i}'s logprob differs by {diff}"
        values, _ = ref[i - 1].topk(len(lp.top))
        ours = torch.tensor([v for _, v in lp.top])
        assert (ours - values).abs().max().item() <= tol, f"{label}: token {i}'s top-{TOP} differ"
        assert all(ref[i - 1, t].item() == pytest.approx(v, abs=tol) for t, v in lp.top), label
        # vLLM's rank: 1 + the tokens likelier than it, give or take those within tol of it
        chosen = ref[i - 1, ids[i]]
        lo, hi = ((ref[i - 1] > chosen + d).sum().item() + 1 for d in (tol, -tol))
        assert lo <= lp.rank <= hi, f"{label}: token {i}'s rank {lp.rank} is not within [{lo}, {hi}]"


@pytest.mark.parametrize("case", list(CASES))
def test_tiny_model_prompt_logprobs_match_transformers(case, tmp_path, tokenizer_json):
    from batchjob.engine.engine import Engine

    hf = build(case, tmp_path, tokenizer_json)
    longrope = "longrope" in case  # within LongRoPE's original positions transformers keeps the short factors
    engine = Engine(
        str(tmp_path), dtype="float32", device="cpu", ops_backend="torch", num_threads=1, block_size=8,
        max_num_batched_tokens=16, **({"max_model_len": PHI3_ORIGINAL_MAX} if longrope else {}),
    )  # fmt: skip
    g = torch.Generator().manual_seed(len(case))
    lengths = (5, 30, 45) if longrope else (5, 37, 100)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]
    # scoring (no token drawn), and vLLM's prompt_logprobs beside generation
    scored = engine.score(prompts, prompt_logprobs=TOP, use_tqdm=False)
    generated = engine.generate(prompts, SamplingParams(max_tokens=2, prompt_logprobs=TOP), use_tqdm=False)
    for ids, score, gen in zip(prompts, scored, generated):
        ref = reference_logprobs(hf, ids)
        assert ref.exp().max(-1).values.mean() < 0.99, "distributions too peaked to compare"
        assert score.error is None and score.num_scored_tokens == len(ids) - 1
        assert_prompt_logprobs_match([None, *score.token_logprobs], ids, ref, 1, f"{case}, score of {len(ids)}")
        assert_prompt_logprobs_match(gen.prompt_logprobs, ids, ref, 1, f"{case}, generate of {len(ids)}")
        want = -sum(ref[i - 1, ids[i]].item() for i in range(1, len(ids)))
        assert score.sum_nll == pytest.approx(want, abs=TOL * len(ids))


def test_real_model_prompt_logprobs_match_transformers(engine, hf_oracle, oracle_prompts):
    """The default model on real chat prompts up to about 1,500 tokens (chunked by the engine's token budget), within
    1e-3 as its logits are in tests/oracle/test_oracle.py (30 layers; the tiny models' 1e-4 is for 2)."""
    hf, _ = hf_oracle
    tok = engine.tokenizer
    prompts = [tok.encode_chat(m) for m in oracle_prompts[:4] + oracle_prompts[-2:]]
    budget = engine.token_budget
    engine.set_token_budget(256)  # the longest prompts in several chunks
    try:
        scores = engine.score(prompts, prompt_logprobs=TOP, use_tqdm=False)
    finally:
        engine.set_token_budget(budget)
    assert max(len(p) for p in prompts) > 2 * 256
    for ids, score in zip(prompts, scores):
        ref = reference_logprobs(hf, ids)
        assert_prompt_logprobs_match([None, *score.token_logprobs], ids, ref, 1, f"prompt of {len(ids)}", 1e-3)
