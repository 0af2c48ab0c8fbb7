"""Embedder.embed() on all-MiniLM-L6-v2 against sentence-transformers: input order across token-budget batches,
truncation, the empty text, token-id prompts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from batchjob.engine.embedder import Embedder, token_budget_batches
from batchjob.model.cpu_features import has_native_bf16


@pytest.fixture(scope="module")
def embedder(minilm) -> Embedder:
    # A small budget: the 44 texts run in several batches, sorted by length, so that input order is exercised.
    return Embedder(str(minilm), max_num_batched_tokens=1024)


def test_default_dtype_matches_sentence_transformers(embedder, embed_texts, st_embeddings):
    assert embedder.dtype == (torch.bfloat16 if has_native_bf16() else torch.float32)
    outputs = embedder.embed(embed_texts, use_tqdm=False)
    ours = torch.tensor([o.embedding for o in outputs])
    assert all(o.outputs.embedding is o.embedding for o in outputs)
    cosine = F.cosine_similarity(ours, st_embeddings)
    assert cosine.min() >= 0.999, f"row {int(cosine.argmin())}: cosine {float(cosine.min()):.6f}"


def test_truncation_is_reported(embedder, embed_texts):
    outputs = embedder.embed(embed_texts, use_tqdm=False)
    full = embedder.encoder.tokenizer.encode_batch(embed_texts)  # truncating: overflowing holds the rest
    for text, out, enc in zip(embed_texts, outputs, full):
        assert out.truncated is bool(enc.overflowing), text[:40]
        assert len(out.prompt_token_ids) == (256 if out.truncated else len(enc.ids))
    assert 0 < sum(o.truncated for o in outputs) < len(outputs)


def test_empty_text_is_its_special_tokens(embedder, embed_texts, st_embeddings):
    """ "" is [CLS] [SEP] and gets an embedding (as sentence-transformers gives it), not an error."""
    (out,) = embedder.embed([""], use_tqdm=False)
    assert out.prompt_token_ids == [101, 102] and not out.truncated
    expected = st_embeddings[embed_texts.index("")]
    assert F.cosine_similarity(torch.tensor(out.embedding), expected, dim=0) >= 0.999


def test_token_ids_as_prompts(embedder):
    (text,) = embedder.embed("Hi.", use_tqdm=False)
    (ids,) = embedder.embed([text.prompt_token_ids], use_tqdm=False)
    assert ids.embedding == text.embedding and ids.prompt_token_ids == text.prompt_token_ids
    with pytest.raises(ValueError, match="1 to 256"):
        embedder.embed([[]], use_tqdm=False)
    with pytest.raises(ValueError, match="1 to 256"):
        embedder.embed([[101] * 257], use_tqdm=False)
    with pytest.raises(ValueError, match="vocabulary"):
        embedder.embed([[101, 30522, 102]], use_tqdm=False)


def test_token_budget_batches():
    lengths = [5, 1, 9, 3, 20, 4]
    assert token_budget_batches(lengths, 10) == [[1, 3, 5], [0], [2], [4]]
    assert token_budget_batches([], 10) == []
