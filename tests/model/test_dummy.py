"""load_format dummy: seeded random weights with a real config; the engine on them equals transformers on them."""

from __future__ import annotations

import json

import pytest
import torch

from batchjob.engine.engine import Engine
from batchjob.engine.sampling_params import SamplingParams
from batchjob.model.config import ModelConfig, weight_shapes
from batchjob.model.dummy import CONFIGS_DIR, dummy_config_path, load_dummy, synthetic_tokenizer
from batchjob.model.errors import ModelNotFoundError

TINY = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
    "initializer_range": 0.05,
}


@pytest.fixture
def tiny_config(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))
    return path


def test_same_seed_same_weights_other_seed_other_weights(tiny_config):
    a, b, c = (load_dummy(str(tiny_config), seed) for seed in (0, 0, 1))
    assert a.weights.keys() == b.weights.keys() == c.weights.keys()
    assert all(torch.equal(a.weights[k], b.weights[k]) for k in a.weights)
    assert not torch.equal(a.weights["model.embed_tokens.weight"], c.weights["model.embed_tokens.weight"])
    assert a.digest == b.digest != c.digest
    w = a.weights["model.layers.0.mlp.down_proj.weight"]
    assert abs(float(w.std()) - 0.05) < 0.005  # the config's initializer_range
    assert torch.equal(a.weights["model.norm.weight"], torch.ones(64))


def test_shipped_configs_by_name_and_the_builtin_architecture(loaded):
    assert {p.stem for p in CONFIGS_DIR.glob("*.json")} >= {"smollm2-135m-instruct", "llama-3-8b"}
    shipped = ModelConfig.from_hf(json.loads(dummy_config_path("smollm2-135m-instruct").read_text()))
    fields = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    fields += ("num_key_value_heads", "head_dim", "rope_theta", "tie_word_embeddings", "max_position_embeddings")
    assert {f: getattr(shipped, f) for f in fields} == {f: getattr(loaded.config, f) for f in fields}
    big = ModelConfig.from_hf(json.loads(dummy_config_path("llama-3-8b").read_text()))
    params = sum(torch.Size(s).numel() for s in weight_shapes(big).values())
    assert 8.0e9 < params < 8.1e9  # Llama-3-8B has 8.03B parameters
    with pytest.raises(ModelNotFoundError, match="llama-3-8b"):
        dummy_config_path("no-such-config")


@pytest.mark.parametrize(
    "name,total,active",
    # Qwen3-0.6B: 0.6B; Qwen3-30B-A3B: 30.5B, 3.3B of them a token's (its model card's figures)
    [("qwen3-0.6b", (0.59e9, 0.61e9), None), ("qwen3-30b-a3b", (30.4e9, 30.6e9), (3.2e9, 3.4e9))],
)
def test_shipped_qwen3_configs_have_their_models_parameter_counts(name, total, active):
    c = ModelConfig.from_hf(json.loads(dummy_config_path(name).read_text()))
    shapes = weight_shapes(c)
    params = sum(torch.Size(s).numel() for s in shapes.values())
    assert total[0] < params < total[1]
    if active:
        idle = c.num_experts - c.num_experts_per_tok  # the experts a token skips, in every layer
        per_expert = 3 * c.hidden_size * c.moe_intermediate_size
        assert active[0] < params - c.num_hidden_layers * idle * per_expert < active[1]


def test_synthetic_tokenizer_round_trips_bytes():
    tok = synthetic_tokenizer()
    ids = tok.encode("héllo, wörld")
    assert max(ids) < 256 and tok.decode(ids) == "héllo, wörld"


def test_engine_on_dummy_weights_equals_transformers_greedy(tiny_config):
    """Names and shapes are HF's (strict load), and 12 greedy tokens of a batch equal transformers' generate on the
    same seeded draw: the weights are a real model's, not just tensors of the right size."""
    from transformers import AutoConfig, AutoModelForCausalLM

    engine = Engine(
        str(tiny_config), load_format="dummy", seed=3, device="cpu", num_kv_blocks=64, block_size=4, dtype="float32"
    )
    assert engine.tokenizer.vocab_size == 256  # the built-in's 49k vocabulary does not fit 512 ids: bytes
    hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(tiny_config)), dtype=torch.float32).eval()
    hf.load_state_dict(load_dummy(str(tiny_config), 3).weights, strict=True)
    prompts = [[5, 17, 300, 42, 9, 77, 120], [400, 3, 3, 8]]
    outs = engine.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0)
        assert out.token_ids == ref[0, len(prompt) :].tolist()


def test_builtin_architecture_on_dummy_weights_decodes_varied_tokens():
    """The scales keep greedy decoding of a 30-layer model from collapsing onto one repeated token."""
    engine = Engine("smollm2-135m-instruct", load_format="dummy", device="cpu", num_kv_blocks=32)
    outs = engine.generate(["The capital of France is", "Once upon a time"], SamplingParams(max_tokens=16))
    assert all(len(set(o.token_ids)) > 8 for o in outs)
