"""The BERT encoder on packed rows against sentence-transformers on all-MiniLM-L6-v2, its pooling against torch
written one sequence at a time, and a folder's pooling and Normalize settings read as sentence-transformers reads
them."""

from __future__ import annotations

import json
from itertools import accumulate, pairwise
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from batchjob.model.encoder import Encoder, load_encoder
from batchjob.model.errors import ModelLoadError
from batchjob.model.packed import PackedBatch
from batchjob.model.pooling import Pooling

MIN_COSINE = {torch.float32: 0.9999, torch.bfloat16: 0.999}
# Lengths near and apart, repeated, odd and even, below and past a multiple of 16 or 64: passes that pad differently.
INVARIANCE_LENGTHS = [2, 3, 3, 5, 9, 12, 15, 16, 17, 17, 31, 33, 40, 63, 64, 65, 100, 128, 129, 200, 255, 256]


def cu_seqlens_of(ids: list[list[int]]) -> list[int]:
    return [0, *accumulate(map(len, ids))]


@pytest.fixture(scope="module")
def fp32_encoder(minilm):
    return load_encoder(minilm, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_matches_sentence_transformers(minilm, fp32_encoder, embed_texts, st_embeddings, dtype):
    encoder = fp32_encoder if dtype == torch.float32 else load_encoder(minilm, dtype)
    ids = [t.token_ids for t in encoder.tokenize(embed_texts)]
    ours = encoder.embed(ids)  # all 44 in one packed pass, lengths 2 to 256 mixed
    cosine = F.cosine_similarity(ours, st_embeddings)
    assert cosine.min() >= MIN_COSINE[dtype], f"row {int(cosine.argmin())}: cosine {float(cosine.min()):.6f}"


def test_packed_batch_equals_each_sequence_alone(fp32_encoder, embed_texts):
    ids = [t.token_ids for t in fp32_encoder.tokenize(embed_texts[::4])]
    hidden = fp32_encoder.model(PackedBatch.build(ids))
    for row, (start, end) in zip(ids, pairwise(cu_seqlens_of(ids))):
        alone = fp32_encoder.model(PackedBatch.build([row]))
        torch.testing.assert_close(hidden[start:end], alone, atol=1e-5, rtol=1e-5)


def assert_batch_invariant(encoder: Encoder, ids: list[list[int]]) -> None:
    """Each row's embedding bit for bit what it gets alone, in passes of every size from 2 to 16 over `ids` (which
    are near in length where sorted, as the embedder's passes are): which rows share its pass, and so how far its
    attention is padded and how many rows its matmuls take, must not change a bit of it (a job resumed after a kill
    cuts its passes elsewhere)."""
    alone = [encoder.embed([row])[0] for row in ids]
    for size in range(2, 17):
        for start in range(0, len(ids) - size + 1, size):
            batch = ids[start : start + size]
            for i, (got, row) in enumerate(zip(encoder.embed(batch), batch)):
                same, diff = torch.equal(got, alone[start + i]), (got - alone[start + i]).abs().max().item()
                assert same, f"{len(row)} tokens among {len(batch)} rows: differs from alone by {diff}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_rows_embedding_does_not_depend_on_its_pass(minilm, fp32_encoder, embed_texts, dtype):
    encoder = fp32_encoder if dtype == torch.float32 else load_encoder(minilm, dtype)
    ids = sorted((t.token_ids for t in encoder.tokenize(embed_texts)), key=len)
    assert_batch_invariant(encoder, [row[:n] for row, n in zip(ids[::-1], INVARIANCE_LENGTHS)])


@pytest.mark.parametrize("mode", ["mean", "cls", "lasttoken"])
def test_pooling_against_each_sequence_in_torch(fp32_encoder, embed_texts, mode):
    ids = [t.token_ids for t in fp32_encoder.tokenize(embed_texts[36:])]
    hidden, cu_seqlens = fp32_encoder.model(PackedBatch.build(ids)), cu_seqlens_of(ids)
    rows = {"mean": lambda h: h.mean(0), "cls": lambda h: h[0], "lasttoken": lambda h: h[-1]}[mode]
    reference = torch.stack([rows(hidden[s:e]) for s, e in pairwise(cu_seqlens)])
    torch.testing.assert_close(Pooling(mode, normalize=False)(hidden, cu_seqlens), reference)
    normalized = Pooling(mode, normalize=True)(hidden, cu_seqlens)
    torch.testing.assert_close(normalized, reference / reference.norm(dim=-1, keepdim=True))


def variant(minilm: Path, folder: Path, pooling: dict, normalize: bool) -> Path:
    """minilm's folder with another 1_Pooling/config.json, and modules.json with or without Normalize."""
    (folder / "1_Pooling").mkdir(parents=True)
    for f in minilm.iterdir():
        if f.is_file() and f.name != "modules.json":
            (folder / f.name).symlink_to(f)
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 384, **pooling}))
    modules = json.loads((minilm / "modules.json").read_text())
    kept = [m for m in modules if normalize or not m["type"].endswith(".Normalize")]
    (folder / "modules.json").write_text(json.dumps(kept))
    return folder


@pytest.mark.parametrize(
    ("pooling", "normalize"),
    [
        ({"pooling_mode_cls_token": True}, False),
        ({"pooling_mode_lasttoken": True}, True),
        ({"pooling_mode_mean_tokens": True}, False),
    ],
    ids=["cls-unnormalized", "lasttoken-normalized", "mean-unnormalized"],
)
def test_folder_pooling_matches_sentence_transformers(minilm, tmp_path, embed_texts, pooling, normalize):
    st = pytest.importorskip("sentence_transformers", reason="the test extra's sentence-transformers")
    folder = variant(minilm, tmp_path / "variant", pooling, normalize)
    texts = embed_texts[38:]
    expected = torch.from_numpy(st.SentenceTransformer(str(folder), device="cpu").encode(texts))
    encoder = load_encoder(folder, torch.float32)
    assert encoder.pooling.normalize is normalize
    ours = encoder.embed([t.token_ids for t in encoder.tokenize(texts)])
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-4)


def test_unsupported_pooling_is_refused(minilm, tmp_path):
    folder = variant(minilm, tmp_path / "variant", {"pooling_mode_max_tokens": True}, normalize=True)
    with pytest.raises(ModelLoadError, match="pooling"):
        load_encoder(folder, torch.float32)
