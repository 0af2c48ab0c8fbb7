"""The arithmetic versions (model/arithmetic.py) against what each numerics path computes: a digest of each path's
results on a fixed tiny model is pinned beside the version it was taken at, so that a change of the arithmetic that
moves a bit of the results, made without bumping the path's version, fails here. The digests hold for one machine
kind (its torch and the CPU's instruction sets pick the kernels); elsewhere the test checks that each path's results
repeat, and says what to pin."""

from __future__ import annotations

import hashlib

import pytest
import torch

from batchjob.model import cpu_ops
from batchjob.model.arithmetic import VERSIONS, arithmetic_label, arithmetic_path
from batchjob.model.bert import BertConfig, BertModel
from batchjob.model.config import ModelConfig
from batchjob.model.cpu_features import ISA_FLAGS, cpu_flags
from batchjob.model.decoder_embedding import DecoderEmbeddingModel
from batchjob.model.llama import LlamaModel
from batchjob.model.packed import PackedBatch
from batchjob.model.pooling import Pooling
from tests.conftest import forward_logits

QWEN2 = {
    "architectures": ["Qwen2ForCausalLM"],
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "tie_word_embeddings": True,
}
BERT = BertConfig(256, 64, 2, 4, 128, 512, 2, 1e-12, "gelu")
IDS = [(i * 37 + 11) % 256 for i in range(70)]  # 70 rows: more than a 64-row block
SEQUENCES = [IDS[:5], IDS[5:22], IDS[22:40], IDS[40:70]]

# (torch, the CPU's instruction sets) -> path -> {version: digest of its results at that version}. A change that
# moves the results gets a new version, and a new digest beside it; the old ones stay.
PINNED: dict[tuple[str, str], dict[str, dict[int, str]]] = {
    ("2.13.0+cpu", "avx2 fma avx512f avx512_bf16 avx512_vnni"): {  # the project's AMD EPYC
        "float32": {1: "d49525e3de275585"},
        "bfloat16": {2: "68b40c655a3433ee", 3: "92062716e730b4d8"},
        "w8a8": {2: "88e6240f720ede08"},
        "embed float32": {1: "6e05fadfd080bb81", 2: "966b182791ca8a19"},
        "embed bfloat16": {1: "394c36df50f3fe69", 2: "4b348b040766c0d2"},
    },
}


def qwen2_weights(dtype: torch.dtype, seed: int = 0) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """A tiny Qwen2 (q/k/v biases), random weights of a trained model's scale, some input channels 30x the rest (as
    the outliers smoothing is for)."""
    config = ModelConfig.from_hf(QWEN2)
    gen = torch.Generator().manual_seed(seed)
    h, i, kv = config.hidden_size, config.intermediate_size, config.num_key_value_heads * config.head_dim

    def rand(*shape: int, scale: float = 0.08) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    norm = (1 + torch.rand(h, generator=gen)) * torch.where(torch.arange(h) % 13 == 0, 30.0, 1.0)
    w = {"model.embed_tokens.weight": rand(config.vocab_size, h, scale=1.0), "model.norm.weight": rand(h) + 1}
    for layer in range(config.num_hidden_layers):
        p = f"model.layers.{layer}."
        w |= {p + "input_layernorm.weight": norm.to(dtype), p + "post_attention_layernorm.weight": norm.to(dtype)}
        for name, rows in (("q", h), ("k", kv), ("v", kv)):
            w |= {p + f"self_attn.{name}_proj.weight": rand(rows, h), p + f"self_attn.{name}_proj.bias": rand(rows)}
        w |= {p + "self_attn.o_proj.weight": rand(h, h), p + "mlp.down_proj.weight": rand(h, i)}
        w |= {p + "mlp.gate_proj.weight": rand(i, h), p + "mlp.up_proj.weight": rand(i, h)}
    return config, w


def decoder(dtype: torch.dtype, w8a8: bool = False, lm_head: bool = True) -> LlamaModel:
    config, weights = qwen2_weights(dtype)
    return LlamaModel(config, weights, cpu_ops, lm_head=lm_head, w8a8=w8a8, calibration=IDS if w8a8 else None)


def bert(dtype: torch.dtype) -> BertModel:
    gen = torch.Generator().manual_seed(1)
    c, names = BERT, {}
    shapes = {
        "embeddings.word_embeddings.weight": (c.vocab_size, c.hidden_size),
        "embeddings.position_embeddings.weight": (c.max_position_embeddings, c.hidden_size),
        "embeddings.token_type_embeddings.weight": (2, c.hidden_size),
        "embeddings.LayerNorm.weight": (c.hidden_size,),
        "embeddings.LayerNorm.bias": (c.hidden_size,),
    }
    for layer in range(c.num_hidden_layers):
        p = f"encoder.layer.{layer}."
        for name, rows, cols in (
            ("attention.self.query", c.hidden_size, c.hidden_size),
            ("attention.self.key", c.hidden_size, c.hidden_size),
            ("attention.self.value", c.hidden_size, c.hidden_size),
            ("attention.output.dense", c.hidden_size, c.hidden_size),
            ("intermediate.dense", c.intermediate_size, c.hidden_size),
            ("output.dense", c.hidden_size, c.intermediate_size),
        ):
            shapes |= {p + name + ".weight": (rows, cols), p + name + ".bias": (rows,)}
        for norm in ("attention.output.LayerNorm", "output.LayerNorm"):
            shapes |= {p + norm + ".weight": (c.hidden_size,), p + norm + ".bias": (c.hidden_size,)}
    for name, shape in shapes.items():
        scale = 1.0 if "embeddings" in name else 0.1
        names[name] = (torch.randn(*shape, generator=gen) * scale + (1 if "LayerNorm.weight" in name else 0)).to(dtype)
    return BertModel(c, names, cpu_ops)


def results(path: str) -> list[torch.Tensor]:
    """What the path computes on the tiny models: a decoder's logits of every row, or an embedding model's
    (a BERT encoder's and a decoder's) pooled embeddings of a packed batch."""
    task, _, kind = path.rpartition(" ")
    dtype = torch.float32 if kind == "w8a8" else getattr(torch, kind)
    if task != "embed":
        model = decoder(dtype, w8a8=kind == "w8a8")
        # and where the path scores through a fused head (bf16_dot_logprobs), its results on fixed bf16 rows
        scored = model.score_tokens(model.embed[IDS[:-1]], torch.tensor(IDS[1:]))
        return [forward_logits(model, IDS, last_only=False), *(scored or ())]
    batch = PackedBatch.build(SEQUENCES)
    pooling = Pooling("mean", normalize=True)
    embedders = [bert(dtype), DecoderEmbeddingModel(decoder(dtype, lm_head=False))]
    return [pooling(model(batch), batch.cu_seqlens) for model in embedders]


def digest(tensors: list[torch.Tensor]) -> str:
    sha = hashlib.sha256()
    for t in tensors:
        sha.update(t.float().contiguous().numpy().tobytes())
    return sha.hexdigest()[:16]


def machine() -> tuple[str, str]:
    return torch.__version__, " ".join(f for f in ISA_FLAGS if f in cpu_flags().split())


CPU_PATHS = ["float32", "bfloat16", "w8a8", "embed float32", "embed bfloat16"]


@pytest.mark.parametrize("path", CPU_PATHS)
def test_a_change_of_results_bumps_the_paths_version(path):
    got = digest(results(path))
    assert digest(results(path)) == got  # a path's results are its own, run after run
    pinned = PINNED.get(machine(), {}).get(path)
    if pinned is None:  # a machine kind with no digest pinned: repeatability is what holds here; what to pin is said
        print(f"no digest pinned for {machine()}: {path} v{VERSIONS[path]} gives {got}")
        return
    assert pinned == {**pinned, VERSIONS[path]: got}, (
        f"{path}'s results changed at version {VERSIONS[path]} (digest {got}): bump its version in "
        "batchjob/model/arithmetic.py and pin the new digest beside it here"
    )


def test_every_path_has_a_version_and_the_label_records_it_from_2_on():
    assert arithmetic_path("bfloat16") == "bfloat16" and arithmetic_path("float32", "w8a8") == "w8a8"
    assert arithmetic_path("bfloat16", task="embed") == "embed bfloat16"
    assert {arithmetic_path(d, task=t) for d in ("float32", "bfloat16", "float16") for t in ("generate", "embed")} | {
        "w8a8",
        "quantized float32",
        "quantized bfloat16",
    } == set(VERSIONS)
    assert arithmetic_path("bfloat16", "quantized") == "quantized bfloat16"
    assert arithmetic_label("float32") == {} and arithmetic_label("w8a8") == {"arithmetic": str(VERSIONS["w8a8"])}
