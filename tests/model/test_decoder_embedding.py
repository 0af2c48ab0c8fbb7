"""Decoder embedders (gte-Qwen2, Qwen3-Embedding style) against sentence-transformers: tiny random Qwen2, Qwen3 and
Llama decoders saved as sentence-transformers folders, embedded by the Embedder on packed batches through the paged
attention of the CPU backend; prompts, last-token and mean pooling, a packed batch against each sequence alone."""

from __future__ import annotations

import json
from itertools import pairwise
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

st = pytest.importorskip("sentence_transformers", reason="the test extra's sentence-transformers")
transformers = pytest.importorskip("transformers", reason="the test extra's transformers")

from tokenizers import processors  # noqa: E402

from batchjob.engine.embedder import Embedder  # noqa: E402
from batchjob.model.cpu_features import has_native_bf16  # noqa: E402
from batchjob.model.decoder_embedding import DecoderEmbeddingModel  # noqa: E402
from batchjob.model.encoder import load_encoder  # noqa: E402
from batchjob.model.errors import ModelLoadError  # noqa: E402
from batchjob.model.packed import PackedBatch  # noqa: E402
from tests.model.test_encoder import INVARIANCE_LENGTHS, assert_batch_invariant, cu_seqlens_of  # noqa: E402
from tests.oracle.test_tiny_architectures import COMMON, _randomize, tiny_tokenizer  # noqa: E402

QUERY = "Instruct: Given a question, find the passage that answers it\nQuery:"
MAX_SEQ_LENGTH = 200


def save_decoder(folder: Path, config) -> None:
    """A random decoder (its *ForCausalLM, LM head included) and a tokenizer that ends every text with
    <|endoftext|>, as Qwen3-Embedding's and gte-Qwen2's do for last-token pooling."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    _randomize(model)
    model.save_pretrained(folder)
    tok = tiny_tokenizer()
    eos = "<|endoftext|>"
    tok.post_processor = processors.TemplateProcessing(single=f"$A {eos}", special_tokens=[(eos, tok.token_to_id(eos))])
    (folder / "tokenizer.json").write_text(tok.to_str())
    # PreTrainedTokenizerFast reads tokenizer.json as it is (Qwen2Tokenizer would build its own pre-tokenizer)
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "pad_token": eos}
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))


def st_folder(tmp_path_factory, config) -> Path:
    """Saved by sentence-transformers itself: the bare *Model at the root (no LM head, names without `model.`),
    last-token pooling, Normalize, named prompts, max_seq_length in tokenizer_config.json."""
    from sentence_transformers.sentence_transformer import modules

    hf = tmp_path_factory.mktemp("hf")
    save_decoder(hf, config)
    transformer = modules.Transformer(str(hf), max_seq_length=MAX_SEQ_LENGTH)
    pooling = modules.Pooling(COMMON["hidden_size"], pooling_mode="lasttoken")
    model = st.SentenceTransformer(
        modules=[transformer, pooling, modules.Normalize()], prompts={"query": QUERY, "document": ""}, device="cpu"
    )
    folder = tmp_path_factory.mktemp("st")
    model.save(str(folder))
    saved = json.loads((folder / "config.json").read_text())["architectures"]
    assert saved == [type(config).__name__.replace("Config", "Model")]
    return folder


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory) -> Path:
    """gte-Qwen2's shape: Qwen2 with q/k/v biases."""
    config = transformers.Qwen2Config(**COMMON, num_key_value_heads=2, tie_word_embeddings=True)
    return st_folder(tmp_path_factory, config)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> Path:
    """Qwen3-Embedding's shape: Qwen3 with q/k norms, head_dim apart from hidden_size / heads."""
    config = transformers.Qwen3Config(**COMMON, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True)
    return st_folder(tmp_path_factory, config)


@pytest.fixture(scope="module")
def llama_mean(tmp_path_factory) -> Path:
    """Written by hand as sentence-transformers < 6 wrote it: the whole LlamaForCausalLM at the root (LM head and
    `model.` names), mean pooling by the legacy flag with include_prompt false, no Normalize, max_seq_length in
    sentence_bert_config.json."""
    folder = tmp_path_factory.mktemp("llama-st")
    save_decoder(folder, transformers.LlamaConfig(**COMMON, num_key_value_heads=2, tie_word_embeddings=False))
    (folder / "1_Pooling").mkdir()
    pooling = {"word_embedding_dimension": COMMON["hidden_size"], "pooling_mode_mean_tokens": True}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({**pooling, "include_prompt": False}))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": MAX_SEQ_LENGTH}))
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    (folder / "modules.json").write_text(json.dumps(modules))
    return folder


@pytest.fixture(scope="module")
def texts(embed_texts) -> list[str]:
    """embed_texts (many cut at MAX_SEQ_LENGTH) and a document's first 10 to 400 characters: lengths 1 to 200."""
    return [*embed_texts, *(embed_texts[0][:n] for n in (10, 20, 30, 50, 70, 100, 120, 150, 180, 250, 400))]


def st_encode(folder: Path, texts: list[str], **kwargs) -> torch.Tensor:
    return torch.from_numpy(st.SentenceTransformer(str(folder), device="cpu").encode(texts, **kwargs))


def ours(folder: Path, texts: list[str], **config) -> torch.Tensor:
    # a small budget: the texts run in several packed batches
    embedder = Embedder(str(folder), max_num_batched_tokens=512, **config)
    return torch.tensor([o.embedding for o in embedder.embed(texts, use_tqdm=False)])


def assert_values(a: torch.Tensor, b: torch.Tensor) -> None:
    """fp32 embeddings equal, value by value: an unnormalised mean (llama_mean) pooled with a wrong divisor (the
    prompt's tokens counted, say) is only scaled, which a cosine cannot see."""
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def assert_cosine(a: torch.Tensor, b: torch.Tensor, least: float) -> None:
    cosine = F.cosine_similarity(a, b)
    assert cosine.min() >= least, f"row {int(cosine.argmin())}: cosine {float(cosine.min()):.6f}"


@pytest.mark.parametrize("name", ["qwen2", "qwen3", "llama_mean"])
def test_matches_sentence_transformers(name, request, texts):
    folder = request.getfixturevalue(name)
    encoder = load_encoder(folder, torch.float32)
    assert isinstance(encoder.model, DecoderEmbeddingModel) and encoder.max_seq_length == MAX_SEQ_LENGTH
    lengths = [len(t.token_ids) for t in encoder.tokenize(texts)]
    assert min(lengths) == 1 and max(lengths) == MAX_SEQ_LENGTH and len(set(lengths)) > 10
    expected = st_encode(folder, texts)
    assert_values(ours(folder, texts, dtype="float32"), expected)
    default = Embedder(str(folder))
    assert default.dtype == (torch.bfloat16 if has_native_bf16() else torch.float32)
    assert_cosine(ours(folder, texts), expected, 0.999)


def test_packed_batch_equals_each_sequence_alone(qwen2, texts):
    encoder = load_encoder(qwen2, torch.float32)
    ids = [t.token_ids for t in encoder.tokenize(texts[::3])]
    hidden = encoder.model(PackedBatch.build(ids))
    for row, (start, end) in zip(ids, pairwise(cu_seqlens_of(ids))):
        alone = encoder.model(PackedBatch.build([row]))
        torch.testing.assert_close(hidden[start:end], alone, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_rows_embedding_does_not_depend_on_its_pass(qwen2, texts, dtype):
    encoder = load_encoder(qwen2, dtype)
    ids = sorted((t.token_ids for t in encoder.tokenize(texts)), key=len)
    lengths = [n for n in INVARIANCE_LENGTHS if n <= MAX_SEQ_LENGTH]
    assert_batch_invariant(encoder, [row[:n] for row, n in zip(ids[::-1], lengths)])


def test_prompts_as_sentence_transformers(qwen2, llama_mean, texts):
    """prompt_name and prompt as encode takes them; with include_prompt false (llama_mean) the prompt's tokens are
    left out of the mean, and token-id inputs get no prompt."""
    expected = st_encode(qwen2, texts, prompt_name="query")
    assert_cosine(ours(qwen2, texts, dtype="float32", prompt_name="query"), expected, 0.9999)
    assert_cosine(ours(qwen2, texts, dtype="float32", prompt=QUERY), expected, 0.9999)
    assert_cosine(ours(qwen2, texts, dtype="float32", prompt_name="document"), st_encode(qwen2, texts), 0.9999)
    expected = st_encode(llama_mean, texts, prompt="Represent this: ")
    assert_values(ours(llama_mean, texts, dtype="float32", prompt="Represent this: "), expected)
    embedder = Embedder(str(llama_mean), dtype="float32", prompt="Represent this: ")
    (text,) = embedder.embed(["Hi."], use_tqdm=False)
    (ids,) = embedder.embed([text.prompt_token_ids], use_tqdm=False)  # the whole sequence, prompt included
    expected = load_encoder(llama_mean, torch.float32).embed([text.prompt_token_ids])[0]
    torch.testing.assert_close(torch.tensor(ids.embedding), expected)
    with pytest.raises(ValueError, match="'passage' is not one of the model's prompts"):
        Embedder(str(qwen2), prompt_name="passage")


def test_unsupported_decoder_is_refused(qwen2, tmp_path):
    for f in qwen2.iterdir():
        if f.name != "config.json":
            (tmp_path / f.name).symlink_to(f)
    config = json.loads((qwen2 / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2Model"]}))
    with pytest.raises(ModelLoadError, match="GPT2ForCausalLM"):
        load_encoder(tmp_path, torch.float32)


@pytest.mark.triton
def test_triton_path_equals_cpu_path(qwen2, texts, device):
    """The same packed pass through the Triton kernels (in the interpreter on a CPU): its prefill-only metadata and
    the scratch cache every layer shares work there too."""
    from batchjob.kernels import ops as triton_ops

    cpu = load_encoder(qwen2, torch.float32)
    triton = load_encoder(qwen2, torch.float32, triton_ops, device)
    ids = [t.token_ids for t in cpu.tokenize(texts[-11:-4])]  # 7 texts of 4 to 60 tokens
    expected = cpu.embed(ids)
    torch.testing.assert_close(triton.embed(ids).cpu(), expected, atol=1e-5, rtol=1e-5)


def test_chat_template_modality_is_refused(qwen2, tmp_path):
    """A folder that sentence-transformers 6 saved from a model with a chat template renders texts through it; we
    refuse it rather than embed the texts otherwise."""
    for f in qwen2.iterdir():
        if f.name != "sentence_bert_config.json":
            (tmp_path / f.name).symlink_to(f)
    config = json.loads((qwen2 / "sentence_bert_config.json").read_text())
    message = {"method": "forward", "method_output_name": "last_hidden_state", "format": "flat"}
    config["modality_config"]["message"] = message
    (tmp_path / "sentence_bert_config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="'message' modality"):
        load_encoder(tmp_path, torch.float32)


@pytest.mark.slow
def test_an_embedding_job_on_a_decoder_folder(qwen3, texts, tmp_path):
    """`batchjob run` with task: embed takes a decoder folder as it takes an encoder's: the job layer needs nothing
    of its own for decoders."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tests.helpers import write_parquet
    from tests.job.test_e2e import cli, dataset
    from tests.job.test_embed_jobs import write_job

    texts = [t for t in texts if t]  # an empty text is a job's error row
    data = write_parquet(tmp_path / "texts.parquet", [{"id": f"t{i}", "text": t} for i, t in enumerate(texts)])
    job = write_job(tmp_path / "job.yaml", qwen3, data, tmp_path / "out", engine={"dtype": "float32"})
    result = cli("run", str(job))
    assert result.returncode == 0, result.stdout + result.stderr
    schema = pq.read_schema(next((tmp_path / "out" / "data").glob("*.parquet")))
    assert schema.field("embedding").type == pa.list_(pa.float32(), COMMON["hidden_size"])
    rows = dataset(tmp_path / "out")
    ours = torch.tensor([rows[f"t{i}"]["embedding"] for i in range(len(texts))])
    assert_cosine(ours, st_encode(qwen3, texts), 0.9999)
