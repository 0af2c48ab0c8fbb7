"""A BERT encoder through the Triton kernels (in the interpreter on a CPU): the Embedder with ops_backend triton on a
tiny random BERT (head dim 24, not a power of two) gives the embeddings of ops_backend torch and of transformers'
BertModel, on packed batches of texts from 1 to 160 tokens (past two of the kernel's query tiles); and it makes no
host synchronisation between a batch's copy to the device and the read of its embeddings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
transformers = pytest.importorskip("transformers", reason="the tiny model is made by transformers (test extra)")

from batchjob.engine.embedder import Embedder  # noqa: E402
from batchjob.engine.host_sync import HostSync, forbid_host_sync  # noqa: E402
from batchjob.model.packed import PackedBatch  # noqa: E402
from tests.oracle.test_tiny_architectures import VOCAB, tiny_tokenizer  # noqa: E402

pytestmark = pytest.mark.triton
MAX_SEQ_LENGTH = 160


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory) -> Path:
    """A sentence-transformers folder: a random BertModel (weights large enough that attention is far from
    uniform), mean pooling, Normalize."""
    folder = tmp_path_factory.mktemp("bert-st")
    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=48,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=96,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    model = transformers.BertModel(config, add_pooling_layer=False).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.2 * noise if name.endswith("LayerNorm.weight") else 0.3 * noise)
    model.save_pretrained(folder)
    (folder / "tokenizer.json").write_text(tiny_tokenizer().to_str())
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": MAX_SEQ_LENGTH}))
    (folder / "1_Pooling").mkdir()
    pooling = {"word_embedding_dimension": 48, "pooling_mode_mean_tokens": True}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    (folder / "modules.json").write_text(json.dumps(modules))
    return folder


def test_triton_embedder_equals_torch_embedder_and_transformers(tiny_bert, embed_texts):
    doc = embed_texts[0]
    texts = [*embed_texts[:3], "Hi.", *(doc[:n] for n in (10, 60, 150, 400))]
    # a small budget: several packed passes, of mixed lengths
    common = dict(dtype="float32", device="cpu", max_num_batched_tokens=256)
    torch_embedder = Embedder(str(tiny_bert), ops_backend="torch", **common)
    triton_embedder = Embedder(str(tiny_bert), ops_backend="triton", **common)
    assert triton_embedder.numerics == {**torch_embedder.numerics, "ops_backend": "triton"}
    inputs = [t.token_ids for t in torch_embedder.tokenize(texts)] + [[7]]  # and a one-token sequence
    lengths = sorted(map(len, inputs))
    assert lengths[0] == 1 and lengths[-1] == MAX_SEQ_LENGTH

    def embeddings(embedder: Embedder) -> torch.Tensor:
        return torch.tensor([o.outputs.embedding for o in embedder.embed(inputs, use_tqdm=False)])

    ours, reference = embeddings(triton_embedder), embeddings(torch_embedder)
    assert F.cosine_similarity(ours, reference).min() > 0.99999
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-5)

    hf = transformers.BertModel.from_pretrained(tiny_bert, add_pooling_layer=False).eval()
    with torch.no_grad():
        expected = torch.stack([hf(torch.tensor([ids])).last_hidden_state[0].mean(0) for ids in inputs])
    torch.testing.assert_close(ours, F.normalize(expected, dim=-1), atol=1e-5, rtol=1e-5)


def test_the_triton_path_reads_no_device_value_between_copy_in_and_read_out(tiny_bert, embed_texts):
    """Between the one copy of a batch's inputs to the device and the one read of its pooled embeddings, the Triton
    path (attention kernel, pooling) makes no op whose result the host must wait for. (The torch reference reads the
    sequence lengths with `tolist`, to call SDPA per run of one length: a wait on a GPU that the CPU guard cannot
    see, so the guard's own control here is a read it does see.)"""
    embedder = Embedder(str(tiny_bert), dtype="float32", device="cpu", ops_backend="triton")
    ids = [t.token_ids for t in embedder.tokenize(embed_texts[:4])]
    packed = PackedBatch.build(ids, embedder.device)
    encoder = embedder.encoder
    with forbid_host_sync(embedder.device):
        encoder.pooling(encoder.model(packed), packed.cu_seqlens, packed.prompt_lengths)
    with pytest.raises(HostSync), forbid_host_sync(embedder.device):
        int(packed.cu_seqlens.max())
