"""Embedder.embed() on all-MiniLM-L6-v2 against sentence-transformers: input order across token-budget batches,
truncation, the empty text, token-id prompts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from batchjob.engine.embedder import MAX_PADDING, Embedder, embedding_batches
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


def test_forward_passes_are_cut_at_the_token_budget_and_the_padding_bound():
    lengths = [5, 1, 9, 3, 20, 4]
    assert embedding_batches(lengths, 10, max_padding=100.0) == [[1, 3, 5], [0], [2], [4]]
    # 1 then 3 would be 2 x 3 = 6 slots for 4 tokens, past 1.25x: a pass of its own; 3, 4 and 5 fit (15 <= 15).
    assert embedding_batches(lengths, 100) == [[1], [3, 5, 0], [2], [4]]
    assert embedding_batches([3] * 10 + [256], 8192) == [list(range(10)), [10]]
    assert embedding_batches([], 10) == []


@settings(max_examples=200)
@given(st.lists(st.integers(1, 512), max_size=300), st.integers(16, 4096), st.floats(1.0, 3.0))
def test_every_forward_pass_keeps_within_its_budget_and_padding_bound(lengths, budget, max_padding):
    batches = embedding_batches(lengths, budget, max_padding)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))  # every input once
    order = [lengths[i] for b in batches for i in b]
    assert order == sorted(order)  # shortest first: a pass holds near lengths
    for batch in batches:
        tokens, longest = sum(lengths[i] for i in batch), max(lengths[i] for i in batch)
        assert len(batch) == 1 or tokens <= budget
        assert len(batch) * longest <= max_padding * tokens


def test_one_long_text_among_short_ones_pads_them_no_further_than_the_bound(minilm, embed_texts):
    """The issue's cliff, small: one-word texts with a 400-word one among them. The long one must not pad the
    short ones to its 256 tokens, and each text's embedding is the one it gets alone, in input order."""
    words = " ".join(embed_texts[:40]).split()
    texts = [*words[:150], " ".join(words[:400]), *words[150:300]]
    embedder = Embedder(str(minilm), dtype="float32")  # fp32: the batched and the lone passes agree to rounding
    outputs = embedder.embed(texts, use_tqdm=False)
    stats, real = embedder.stats, sum(len(o.prompt_token_ids) for o in outputs)  # a copy: it does not move on
    assert stats.embedded_tokens == real and len(outputs[150].prompt_token_ids) == 256
    assert real <= stats.padded_tokens <= MAX_PADDING * real, stats
    assert 2 <= stats.forward_passes <= 10, stats
    alone = [embedder.embed([text], use_tqdm=False)[0] for text in texts]
    assert [o.prompt_token_ids for o in outputs] == [a.prompt_token_ids for a in alone]
    torch.testing.assert_close(torch.tensor([o.embedding for o in outputs]), torch.tensor([a.embedding for a in alone]))
    assert embedder.stats.forward_passes == stats.forward_passes + len(texts)  # the stats add up across calls
