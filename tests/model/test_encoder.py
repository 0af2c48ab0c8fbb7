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

from batchjob.model.encoder import load_encoder
from batchjob.model.errors import ModelLoadError
from batchjob.model.packed import PackedBatch
from batchjob.model.pooling import Pooling

MIN_COSINE = {torch.float32: 0.9999, torch.bfloat16: 0.999}


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
