"""A tiny randomly initialised model of each architecture (Llama, Qwen2, Mistral, Qwen3, Qwen3-MoE, Mixtral, Phi-3,
Gemma 2, Gemma 3), saved as an HF folder by transformers inside the test, loaded by our loader: logits and greedy
tokens equal transformers' own."""

from __future__ import annotations

import dataclasses
import json
import math
import re

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the oracle needs the test extra")

from tokenizers import Tokenizer as HFTokenizer  # noqa: E402
from tokenizers import decoders, models, pre_tokenizers, trainers  # noqa: E402

from batchjob.bench.hf_export import export_hf  # noqa: E402
from batchjob.engine.sampling_params import SamplingParams  # noqa: E402
from batchjob.model import cpu_ops as ops  # noqa: E402  (what the engine runs on a CPU)
from batchjob.model import loader  # noqa: E402
from batchjob.model.config import ModelConfig  # noqa: E402
from batchjob.model.gemma import GemmaModel  # noqa: E402
from batchjob.model.llama import LlamaModel  # noqa: E402
from batchjob.model.loader import load_model  # noqa: E402
from tests.conftest import assert_matches_generate, forward_logits, hf_generate  # noqa: E402

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = (
    "The quick brown fox jumps over the lazy dog. A tiny model of each architecture matches the reference "
    "logits, token for token, on random prompts of several lengths; paged caches hold keys and values. "
)
VOCAB = 320
COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=256,
    vocab_size=VOCAB,
    bos_token_id=0,
    eos_token_id=2,
    rms_norm_eps=1e-5,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # head_dim 16, theta 1e4: wavelengths 6..2e4, so all three llama3 bands (<16, 16..64, >64) occur
    "original_max_position_embeddings": 64,
    "rope_theta": 10000.0,
}
# Phi-3-mini-128k / Phi-3.5 / Phi-4-mini's LongRoPE, pretrained on 48 positions here so that test prompts pass it.
PHI3_ORIGINAL_MAX = 48
PHI3 = dict(pad_token_id=0)  # Phi3Config's default pad id, 32000, lies outside the tiny vocabulary


def longrope(rotary_dim: int) -> dict:
    half = rotary_dim // 2
    return {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0 + 0.05 * i for i in range(half)],
        "long_factor": [1.0 + 2.5 * i for i in range(half)],
    }


# name -> (config class, extra config, save_pretrained kwargs)
CASES = {
    "llama-gqa2-untied": ("LlamaConfig", dict(num_key_value_heads=2, tie_word_embeddings=False), {}),
    "llama-mha-tied-llama3rope-sharded": (
        "LlamaConfig",
        dict(num_key_value_heads=4, tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE),
        {"max_shard_size": "60KB"},
    ),
    # Llama's attention_bias biases q/k/v and o_proj; mlp_bias gate/up/down.
    "llama-attention-and-mlp-bias": (
        "LlamaConfig",
        dict(num_key_value_heads=2, attention_bias=True, mlp_bias=True),
        {},
    ),
    "qwen2-gqa4-bias-tied": (
        "Qwen2Config",
        dict(
            num_key_value_heads=1, tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6}
        ),
        {},
    ),
    "qwen2-mha-bias-untied": ("Qwen2Config", dict(num_key_value_heads=4, tie_word_embeddings=False), {}),
    "mistral-gqa2-headdim32-linearrope-sharded": (
        "MistralConfig",
        dict(
            num_key_value_heads=2,
            head_dim=32,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
        ),
        {"max_shard_size": "100KB"},
    ),
    # q/k norms per head; head_dim 32 where hidden / heads is 16
    "qwen3-gqa2-headdim32-tied": (
        "Qwen3Config",
        dict(num_key_value_heads=2, head_dim=32, tie_word_embeddings=True),
        {},
    ),
    # 8 experts, top 2 renormalised; layer 2 dense (mlp_only_layers)
    "qwen3moe-top2of8-normtopk-mlponly": (
        "Qwen3MoeConfig",
        dict(
            num_hidden_layers=3,
            num_key_value_heads=2,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            mlp_only_layers=[2],
            tie_word_embeddings=False,
        ),
        {},
    ),
    # top 3 of 6 as softmax gives them (no renormalising); decoder_sparse_step 2: layers 1 and 3 sparse
    "qwen3moe-top3of6-sparsestep2": (
        "Qwen3MoeConfig",
        dict(
            num_hidden_layers=4,
            num_key_value_heads=4,
            num_experts=6,
            num_experts_per_tok=3,
            moe_intermediate_size=48,
            norm_topk_prob=False,
            decoder_sparse_step=2,
            tie_word_embeddings=True,
        ),
        {},
    ),
    # llama.cpp's qwen3moe: every layer sparse, top-k renormalised
    "qwen3moe-top2of4-allsparse": (
        "Qwen3MoeConfig",
        dict(
            num_key_value_heads=1, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True
        ),
        {},
    ),
    "mixtral-top2of4": (
        "MixtralConfig",
        dict(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False),
        {},
    ),
    # Phi-3: fused qkv_proj and gate_up_proj in the checkpoint. Phi-3-mini-4k's sliding_window (2047 of 4096) caps
    # the context as Mistral's does: 200 here, beyond every test sequence.
    "phi3-mha-untied-window": ("Phi3Config", dict(**PHI3, num_key_value_heads=4, sliding_window=200), {}),
    "phi3-gqa2-tied-partial-rotary": (
        "Phi3Config",
        dict(**PHI3, num_key_value_heads=2, tie_word_embeddings=True, partial_rotary_factor=0.5),
        {},
    ),
    "phi3-gqa2-longrope": (
        "Phi3Config",
        dict(
            **PHI3,
            num_key_value_heads=2,
            rope_parameters=longrope(16),
            original_max_position_embeddings=PHI3_ORIGINAL_MAX,
        ),
        {},
    ),
    # Phi-4-mini's shape: LongRoPE on 3/4 of each head, tied embeddings
    "phi4mini-gqa2-tied-longrope-partial-rotary": (
        "Phi3Config",
        dict(
            **PHI3,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            partial_rotary_factor=0.75,
            rope_parameters=longrope(12),
            original_max_position_embeddings=PHI3_ORIGINAL_MAX,
        ),
        {},
    ),
}
LENGTHS = (5, 37, 100)  # LongRoPE: the first two within its original 48 positions (short factors), the last past them
# Gemma: windows of 8 and 12 tokens, far shorter than the prompts, so that the sliding layers' masks matter; a
# query_pre_attn_scalar that is not head_dim; Gemma 3 with a scaled rope on its global layers and its own local base,
# Gemma 2 with caps low enough that tanh bends the scores and logits it meets.
GEMMA_CASES = {
    "gemma3-gqa2-window8-linearrope": (
        "Gemma3TextConfig",
        dict(
            num_key_value_heads=2,
            head_dim=16,
            num_hidden_layers=4,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
            query_pre_attn_scalar=24,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        ),
        {},
    ),
    "gemma2-mha-window12-softcap": (
        "Gemma2Config",
        dict(
            num_key_value_heads=4,
            head_dim=16,
            num_hidden_layers=3,
            sliding_window=12,
            query_pre_attn_scalar=16,
            attn_logit_softcapping=3.0,
            final_logit_softcapping=8.0,
        ),
        {},
    ),
}
CASES |= GEMMA_CASES


def tiny_tokenizer() -> HFTokenizer:
    """Byte-level BPE trained on a sentence, with im_start/im_end specials; exactly VOCAB tokens."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIALS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([CORPUS] * 4, trainer)
    assert tok.get_vocab_size() == VOCAB
    return tok


@pytest.fixture(scope="module")
def tokenizer_json() -> str:
    return tiny_tokenizer().to_str()


def _randomize(model: torch.nn.Module) -> None:
    """Weights big enough that logits are well separated (greedy ties would make the comparison flaky);
    norms away from 1 and biases non-zero so that both are checked."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * noise)
            elif name.endswith(".bias"):
                p.copy_(0.5 * noise)
            else:
                p.copy_(0.15 * noise)


def build(case: str, folder, tokenizer_json: str):
    cls_name, extra, save_kwargs = CASES[case]
    config = getattr(transformers, cls_name)(**(COMMON | extra))
    torch.manual_seed(0)
    # eager: the attention that soft-caps scores (HF's SDPA path does not)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    _randomize(model)
    if config.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    model.save_pretrained(folder, **save_kwargs)
    (folder / "tokenizer.json").write_text(tokenizer_json)
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "chat_template": CHAT_TEMPLATE})
    )
    return model


@pytest.mark.parametrize("case", [c for c in CASES if c not in GEMMA_CASES])
def test_tiny_model_matches_transformers(case, tmp_path, tokenizer_json):
    hf = build(case, tmp_path, tokenizer_json)
    cls_name, extra, save_kwargs = CASES[case]
    if save_kwargs:
        index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1, "the save was meant to be sharded"

    loaded = load_model(str(tmp_path))
    c = loaded.config
    assert c.architecture == hf.config.architectures[0] == cls_name.replace("Config", "ForCausalLM")
    assert (c.vocab_size, c.num_key_value_heads, c.head_dim) == (
        VOCAB,
        extra["num_key_value_heads"],
        extra.get("head_dim", 16),
    )
    assert c.tie_word_embeddings == hf.config.tie_word_embeddings
    assert ("lm_head.weight" in loaded.weights) != c.tie_word_embeddings
    rope = extra.get("rope_parameters", {})
    assert c.rope_theta == rope.get("rope_theta", hf.config.rope_parameters["rope_theta"])
    assert (c.rope_scaling or {}).get("rope_type") == (
        rope.get("rope_type") if rope.get("rope_type") != "default" else None
    )
    if c.attention_bias:
        assert loaded.weights["model.layers.0.self_attn.q_proj.bias"].abs().min() > 0
    assert c.qk_norm == ("q_norm" in str(hf))
    sparse = [i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts")]
    assert [i for i in range(c.num_hidden_layers) if c.is_moe_layer(i)] == sparse
    if sparse:
        assert (c.num_experts, c.num_experts_per_tok) == (hf.config.num_local_experts, hf.config.num_experts_per_tok)
    assert c.rotary_dim == int(extra.get("head_dim", 16) * extra.get("partial_rotary_factor", 1.0))
    # Our inverse frequencies are transformers' (llama3 / linear scaling, LongRoPE's short factors included).
    hf_inv = hf.model.rotary_emb.inv_freq.double()
    assert torch.allclose(c.inv_freq(), hf_inv, rtol=1e-6, atol=0), (c.inv_freq(), hf_inv)
    assert c.attention_factor() == pytest.approx(hf.model.rotary_emb.attention_scaling, rel=1e-12)
    if c.rope_scaling and c.rope_scaling["rope_type"] == "longrope":
        assert c.attention_factor() > 1.1 and not torch.equal(c.inv_freq(PHI3_ORIGINAL_MAX + 1), c.inv_freq())

    g = torch.Generator().manual_seed(len(case))
    for n in LENGTHS:
        # transformers picks LongRoPE's factors by the length of the forward pass, we by the engine's context
        ours = LlamaModel(c, loaded.weights, ops, loaded.rope_freqs, max_model_len=n)
        ids = torch.randint(0, VOCAB, (n,), generator=g).tolist()
        with torch.inference_mode():
            ref = hf(torch.tensor([ids])).logits[0].float()
        assert ref[-1].std() > 0.3, "logits too flat to compare"
        diff = (forward_logits(ours, ids) - ref[-1]).abs().max().item()
        assert diff <= 1e-4, f"{case}, {n} tokens: last logits differ by {diff}"
        if n == LENGTHS[-1]:
            diff = (forward_logits(ours, ids, last_only=False) - ref).abs().max().item()
            assert diff <= 1e-4, f"{case}, {n} tokens: some position's logits differ by {diff}"


@pytest.mark.parametrize("kind", ["su", "longrope"])
def test_phi3_hub_config_form_gives_transformers_rotary(kind):
    """Phi-3's own config.json files (Phi-3-mini-128k: "su", Phi-3.5 and Phi-4-mini: "longrope") say rope_scaling
    with a `type`, and keep original_max_position_embeddings and partial_rotary_factor beside it."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = longrope(12)
    hub = {
        **COMMON,
        **PHI3,
        "architectures": ["Phi3ForCausalLM"],
        "num_key_value_heads": 2,
        "partial_rotary_factor": 0.75,
        "original_max_position_embeddings": PHI3_ORIGINAL_MAX,
        "rope_theta": 10000.0,
        "rope_scaling": {"type": kind, "short_factor": rope["short_factor"], "long_factor": rope["long_factor"]},
    }
    ours, theirs = ModelConfig.from_hf(hub), transformers.Phi3Config(**hub)
    for seq_len in (None, PHI3_ORIGINAL_MAX + 1):
        inv, factor = ROPE_INIT_FUNCTIONS["longrope"](theirs, "cpu", seq_len=seq_len)
        assert torch.allclose(ours.inv_freq(seq_len), inv.double(), rtol=1e-6, atol=0)
        assert ours.attention_factor() == pytest.approx(factor, rel=1e-12) and factor > 1.1
    assert ours.rotary_dim == 12 and not torch.equal(ours.inv_freq(), ours.inv_freq(PHI3_ORIGINAL_MAX + 1))


def hf_greedy(hf, ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' `generate` on one prompt, greedy, eos off: the new tokens."""
    return hf_generate(hf, ids, max_new_tokens, eos_token_id=VOCAB + 5, pad_token_id=0)[0, len(ids) :].tolist()


@pytest.mark.parametrize(
    "case",
    [
        "llama-mha-tied-llama3rope-sharded",
        "qwen2-gqa4-bias-tied",
        "mistral-gqa2-headdim32-linearrope-sharded",
        "qwen3-gqa2-headdim32-tied",
        "qwen3moe-top2of8-normtopk-mlponly",
        "qwen3moe-top3of6-sparsestep2",
        "mixtral-top2of4",
    ],
)
def test_tiny_model_greedy_generate_matches_transformers(case, tmp_path, tokenizer_json):
    greedy_under_pressure_matches_generate(case, tmp_path, tokenizer_json)


def greedy_under_pressure_matches_generate(
    case: str, folder, tokenizer_json: str, ops_backend: str = "torch", device: str = "cpu"
):
    """Our engine (prompts batched, paged KV) vs `generate` one prompt at a time, eos off; a pool too small for the
    batch (preemption and recompute) and a token budget below the longest prompt (prefill in chunks, in steps
    shared with decodes). Returns the transformers model."""
    from batchjob.engine.engine import Engine

    hf = build(case, folder, tokenizer_json)
    budget = 16
    engine = Engine(
        str(folder),
        num_kv_blocks=8,  # the longest prompt and its tokens take 7 blocks of 8
        block_size=8,
        max_num_batched_tokens=budget,
        kv_watermark=1.0,
        enable_prefix_caching=False,
        device=device,
        ops_backend=ops_backend,
        dtype="float32",
        num_threads=1,
    )
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (3, 20, 45, 11, 30)]
    steps = []
    engine.add_step_callback(steps.append)
    outs = engine.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    assert sum(s.num_preemptions for s in steps) > 0
    assert any(s.num_prefill_tokens and s.num_decode_tokens for s in steps)
    assert all(s.num_prefill_tokens + s.num_decode_tokens <= budget for s in steps)
    for ids, out in zip(prompts, outs):
        assert out.finish_reason == "length"
        assert out.token_ids == hf_greedy(hf, ids, 8), f"{case}, prompt of {len(ids)} tokens"
    return hf


# LongRoPE's two regimes: an engine whose context stays within the original positions uses the short factors, as
# transformers does on sequences that short; one allowed more uses the long factors, as transformers does once a
# sequence is longer (prompts past 48 here, so that every forward pass of `generate` picks them too).
PHI3_SHORT, PHI3_LONG = ({"max_model_len": PHI3_ORIGINAL_MAX}, (3, 20, 30)), ({}, (50, 61, 90))
PHI4 = "phi4mini-gqa2-tied-longrope-partial-rotary"
PHI3_RUNS = [
    pytest.param("phi3-mha-untied-window", {}, (3, 20, 45), "torch", id="phi3-window"),
    pytest.param("phi3-gqa2-tied-partial-rotary", {}, (3, 20, 45), "torch", id="phi3-partial-rotary"),
    pytest.param("phi3-gqa2-longrope", *PHI3_SHORT, "torch", id="phi3-longrope-short"),
    pytest.param("phi3-gqa2-longrope", *PHI3_LONG, "torch", id="phi3-longrope-long"),
    pytest.param(PHI4, *PHI3_SHORT, "torch", id="phi4mini-short"),
    pytest.param(PHI4, *PHI3_LONG, "torch", id="phi4mini-long"),
    # the Triton kernels (in the interpreter on a CPU) on everything Phi-4-mini needs
    pytest.param(PHI4, *PHI3_SHORT, "triton", marks=pytest.mark.triton, id="phi4mini-short-triton"),
    pytest.param(PHI4, *PHI3_LONG, "triton", marks=pytest.mark.triton, id="phi4mini-long-triton"),
]


@pytest.mark.parametrize(("case", "engine_args", "lengths", "ops_backend"), PHI3_RUNS)
def test_tiny_phi3_greedy_under_chunked_prefill_and_preemption_matches_transformers(
    case, engine_args, lengths, ops_backend, tmp_path, tokenizer_json, device
):
    """Prefills cut into chunks of 16 tokens beside decodes, and a pool of 4-token blocks that holds about half of
    what the prompts need, so that sequences are preempted and recomputed: still transformers' tokens."""
    from batchjob.engine.engine import Engine

    hf = build(case, tmp_path, tokenizer_json)
    new_tokens = 8
    need = [-(-(n + new_tokens) // 4) for n in lengths]
    engine = Engine(
        str(tmp_path), device=device if ops_backend == "triton" else "cpu", ops_backend=ops_backend, dtype="float32",
        num_threads=1, block_size=4, max_num_batched_tokens=16, num_kv_blocks=max(max(need) + 1, sum(need) // 2),
        kv_watermark=1.0, enable_prefix_caching=False, **engine_args,
    )  # fmt: skip
    assert engine.max_model_len == engine_args.get("max_model_len", 200 if "window" in case else 256)
    steps = []
    engine.add_step_callback(steps.append)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]
    outs = engine.generate(prompts, SamplingParams(max_tokens=new_tokens, ignore_eos=True))
    assert sum(s.num_preemptions for s in steps) > 0
    assert any(s.num_prefill_tokens and s.num_decode_tokens for s in steps)  # chunks of prefill beside decodes
    for ids, out in zip(prompts, outs):
        assert out.finish_reason == "length"
        assert out.token_ids == hf_greedy(hf, ids, new_tokens), f"{case}, prompt of {len(ids)} tokens"


def test_generation_config_eos_ids_stop_generation(tmp_path, tokenizer_json):
    """An instruct model's end of turn may be an eos id of generation_config.json alone (Phi-3's <|end|>): the
    engine stops there, as transformers' generate does."""
    from batchjob.engine.engine import Engine

    hf = build("phi3-mha-untied-window", tmp_path, tokenizer_json)
    ids = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(4)).tolist()
    ref = hf_greedy(hf, ids, 8)
    end = next(i for i, t in enumerate(ref) if i >= 2 and t not in ref[:i] and t != 2)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, ref[end]]}))
    assert load_model(str(tmp_path)).config.eos_token_ids == (2, ref[end])
    out = Engine(str(tmp_path), device="cpu", dtype="float32", num_kv_blocks=16).generate(
        [ids], SamplingParams(max_tokens=8)
    )[0]
    assert out.finish_reason == "stop" and out.token_ids == ref[: end + 1]


def write_phi3_gguf(hf, path) -> None:
    """`hf` (a Phi-3) as llama.cpp's convert_hf_to_gguf.py writes it: architecture phi3, fused attn_qkv, ffn_up
    holding gate and up, no output tensor when tied, the rotary dims and LongRoPE's factors, original length and
    attention factor in the metadata; float32 tensors, so that the logits can be compared exactly."""
    import gguf

    from tests.model.test_loader import add_gpt2_tokenizer

    c, sd = hf.config, hf.state_dict()
    rope = c.rope_parameters
    rotary_dim = int(c.hidden_size // c.num_attention_heads * rope["partial_rotary_factor"])
    w = gguf.GGUFWriter(str(path), "phi3")
    w.add_context_length(c.max_position_embeddings)
    w.add_rope_scaling_orig_ctx_len(c.original_max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_dimension_count(rotary_dim)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_sliding_window(c.sliding_window or 0)
    add_gpt2_tokenizer(w, tiny_tokenizer())
    tensors = {"token_embd": "model.embed_tokens", "output_norm": "model.norm"}
    if not c.tie_word_embeddings:
        tensors["output"] = "lm_head"
    for i in range(c.num_hidden_layers):
        hf_layer = f"model.layers.{i}."
        tensors |= {
            f"blk.{i}.{ours}": hf_layer + theirs
            for ours, theirs in [
                ("attn_norm", "input_layernorm"),
                ("attn_qkv", "self_attn.qkv_proj"),
                ("attn_output", "self_attn.o_proj"),
                ("ffn_norm", "post_attention_layernorm"),
                ("ffn_up", "mlp.gate_up_proj"),
                ("ffn_down", "mlp.down_proj"),
            ]
        }
    if rope["rope_type"] == "longrope":
        scale = c.max_position_embeddings / c.original_max_position_embeddings
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(c.original_max_position_embeddings)))
        w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    for name, hf_name in tensors.items():
        w.add_tensor(name + ".weight", sd[hf_name + ".weight"].numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("case", ["phi3-mha-untied-window", "phi4mini-gqa2-tied-longrope-partial-rotary"])
def test_tiny_phi3_gguf_matches_transformers(case, tmp_path, tokenizer_json, monkeypatch):
    """A phi3 GGUF of the same weights loads to the HF folder's config and weights, and to transformers' logits in
    both LongRoPE regimes; exported back to an HF folder (the bench's peers read that), transformers computes the
    same logits from it."""
    from batchjob.bench.hf_export import export_hf
    from batchjob.model import loader

    # the GGUF's conversion cached in tmp_path; not all of $BATCHJOB_CACHE, which holds the built C++ kernels
    monkeypatch.setattr(loader, "cache_dir", lambda: tmp_path / "cache")
    hf = build(case, tmp_path / "hf", tokenizer_json)
    write_phi3_gguf(hf, tmp_path / "phi3.gguf")
    loaded, from_hf = load_model(str(tmp_path / "phi3.gguf")), load_model(str(tmp_path / "hf"))
    c = loaded.config
    assert c.architecture == "Phi3ForCausalLM" and c.sliding_window == from_hf.config.sliding_window
    assert (c.partial_rotary_factor, c.rotary_dim, c.tie_word_embeddings, c.max_position_embeddings) == (
        from_hf.config.partial_rotary_factor,
        from_hf.config.rotary_dim,
        from_hf.config.tie_word_embeddings,
        from_hf.config.max_position_embeddings,
    )
    assert c.attention_factor() == pytest.approx(from_hf.config.attention_factor(), rel=1e-6)
    for seq_len in (None, PHI3_ORIGINAL_MAX + 1):
        assert torch.allclose(c.inv_freq(seq_len), from_hf.config.inv_freq(seq_len), rtol=1e-6, atol=0)
    assert set(loaded.weights) == set(from_hf.weights) and loaded.rope_freqs is None
    assert all(torch.equal(loaded.weights[k], from_hf.weights[k]) for k in loaded.weights)
    exported = transformers.AutoModelForCausalLM.from_pretrained(
        export_hf(loaded, tmp_path / "export"), dtype=torch.float32
    ).eval()
    g = torch.Generator().manual_seed(3)
    for n in (37, 100):  # short factors, then long
        ours = LlamaModel(c, loaded.weights, ops, loaded.rope_freqs, max_model_len=n)
        ids = torch.randint(0, VOCAB, (n,), generator=g).tolist()
        with torch.inference_mode():
            ref = hf(torch.tensor([ids])).logits[0].float()
            diff_export = (exported(torch.tensor([ids])).logits[0] - ref).abs().max().item()
        diff = (forward_logits(ours, ids, last_only=False) - ref).abs().max().item()
        assert diff <= 1e-4, f"{case}, {n} tokens: logits differ by {diff}"
        assert diff_export <= 1e-4, f"{case}, {n} tokens: the export's logits differ by {diff_export}"


@pytest.mark.parametrize("case", list(GEMMA_CASES))
def test_tiny_gemma_matches_transformers(case, tmp_path, tokenizer_json):
    """Every position's logits of prompts longer than the window, then the engine against `generate`."""
    hf = build(case, tmp_path, tokenizer_json)
    cls_name, extra, _ = GEMMA_CASES[case]
    loaded = load_model(str(tmp_path))
    c = loaded.config
    assert (
        c.architecture
        == hf.config.architectures[0]
        == cls_name.replace("TextConfig", "Config").replace("Config", "ForCausalLM")
    )
    assert c.layer_types == tuple(hf.config.layer_types) and c.sliding_window == extra["sliding_window"]
    assert sum(c.layer_window(i) is not None for i in range(c.num_hidden_layers)) >= 2
    assert (c.attn_logit_softcapping, c.final_logit_softcapping) == (
        extra.get("attn_logit_softcapping"),
        extra.get("final_logit_softcapping"),
    )
    if cls_name == "Gemma3TextConfig":  # both ropes are transformers' own
        rope = hf.model.rotary_emb
        assert torch.allclose(c.inv_freq(), rope.full_attention_inv_freq.double(), rtol=1e-6, atol=0)
        local = dataclasses.replace(c, rope_theta=c.rope_local_base_freq, rope_scaling=None)
        assert torch.allclose(local.inv_freq(), rope.sliding_attention_inv_freq.double(), rtol=1e-6, atol=0)

    ours = GemmaModel(c, dict(loaded.weights), ops)
    g = torch.Generator().manual_seed(len(case))
    for n in LENGTHS:
        ids = torch.randint(0, VOCAB, (n,), generator=g).tolist()
        with torch.inference_mode():
            ref = hf(torch.tensor([ids])).logits[0].float()
        assert ref[-1].std() > 0.3, "logits too flat to compare"
        diff = (forward_logits(ours, ids, last_only=False, block_size=4) - ref).abs().max().item()
        assert diff <= 1e-4, f"{case}, {n} tokens: some position's logits differ by {diff}"

    assert_engine_matches_generate(hf, tmp_path, case)


def test_tiny_gemma3_gguf_matches_transformers(tmp_path, tokenizer_json, monkeypatch):
    """A tiny Gemma 3 written as llama.cpp writes one (its tensor names, norms stored as 1 + w, no window pattern,
    local rope base or attention scale in the file: the model follows llama.cpp's), loaded from the GGUF: every
    position's logits equal transformers' on the HF model it came from."""
    gguf = pytest.importorskip("gguf")
    case = "gemma3-llamacpp-conventions"
    six = ["sliding_attention"] * 5 + ["full_attention"]  # llama.cpp: one global layer in six
    extra = dict(num_key_value_heads=2, head_dim=16, num_hidden_layers=6, sliding_window=8, layer_types=six)
    extra |= dict(query_pre_attn_scalar=16, rope_parameters={"full_attention": {"rope_theta": 1e6}})
    monkeypatch.setitem(CASES, case, ("Gemma3TextConfig", extra, {}))
    hf = build(case, tmp_path / "hf", tokenizer_json)
    tok = HFTokenizer.from_str(tokenizer_json)
    vocab = tok.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    w = gguf.GGUFWriter(str(tmp_path / "tiny.gguf"), "gemma3")
    w.add_block_count(6)
    w.add_context_length(COMMON["max_position_embeddings"])
    w.add_embedding_length(COMMON["hidden_size"])
    w.add_feed_forward_length(COMMON["intermediate_size"])
    w.add_head_count(COMMON["num_attention_heads"])
    w.add_head_count_kv(2)
    w.add_key_length(16)
    w.add_value_length(16)
    w.add_layer_norm_rms_eps(COMMON["rms_norm_eps"])
    w.add_rope_freq_base(1e6)
    w.add_sliding_window(8)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_merges([" ".join(m) for m in json.loads(tokenizer_json)["model"]["merges"]])
    gguf_names = {
        "model.embed_tokens": "token_embd",
        "model.norm": "output_norm",
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "post_attention_norm",
        "pre_feedforward_layernorm": "ffn_norm",
        "post_feedforward_layernorm": "post_ffw_norm",
        "self_attn.q_norm": "attn_q_norm",
        "self_attn.k_norm": "attn_k_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight":  # tied
            continue
        base = name.removesuffix(".weight")
        if base.startswith("model.layers."):
            layer, rest = base.removeprefix("model.layers.").split(".", 1)
            gname = f"blk.{layer}.{gguf_names[rest]}"
        else:
            gname = gguf_names[base]
        value = t.float().numpy()
        w.add_tensor(gname + ".weight", value + 1 if gname.endswith("norm") else value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    loaded = load_model(str(tmp_path / "tiny.gguf"))
    c = loaded.config
    assert (c.architecture, c.layer_types, c.sliding_window) == ("Gemma3ForCausalLM", tuple(six), 8)
    assert (c.query_pre_attn_scalar, c.rope_theta, c.rope_local_base_freq) == (16, 1e6, 1e4)
    ours = GemmaModel(c, dict(loaded.weights), ops)
    ids = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0].float()
    diff = (forward_logits(ours, ids, last_only=False, block_size=4) - ref).abs().max().item()
    assert diff <= 1e-4, f"some position's logits differ by {diff}"


def assert_engine_matches_generate(hf, folder, case: str, **engine_options) -> None:
    """Our engine on the folder (chunked prefill beside decodes, a pool small enough to preempt) against `generate`
    one prompt at a time: the same greedy tokens, and their logprobs within 1e-4."""
    from batchjob.engine.engine import Engine

    options = dict(device="cpu", dtype="float32", num_threads=1, block_size=4, num_kv_blocks=24) | engine_options
    engine = Engine(str(folder), max_num_batched_tokens=16, max_num_seqs=4, **options)
    steps = []
    engine.add_step_callback(steps.append)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (30, 7, 41, 19)]
    outs = engine.generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True, logprobs=True), use_tqdm=False)
    assert any(s.num_prefill_tokens and s.num_decode_tokens for s in steps)  # chunked prefill beside decodes
    assert sum(s.num_preemptions for s in steps) > 0
    for ids, out in zip(prompts, outs):
        label = f"{case}, prompt of {len(ids)} tokens"
        assert_matches_generate(hf, ids, out, 10, 1e-4, label, eos_token_id=VOCAB + 5, pad_token_id=0)


def test_tiny_folder_tokenizer_and_chat_template(tmp_path, tokenizer_json):
    """The folder's tokenizer.json and tokenizer_config.json are what our Tokenizer reads."""
    build("llama-gqa2-untied", tmp_path, tokenizer_json)
    tok = load_model(str(tmp_path)).tokenizer
    ref = HFTokenizer.from_str(tokenizer_json)
    text = "The lazy fox, naïve 東京 🤖!"
    assert tok.encode(text) == ref.encode(text).ids and tok.decode(tok.encode(text)) == text
    assert (tok.bos_token_id, tok.eos_token_id) == (0, 2)
    ids = tok.encode_chat([{"role": "user", "content": "hi"}])
    assert ids[0] == 1 and ids.count(2) == 1 and tok.decode(ids, skip_special_tokens=False).endswith("assistant\n")


def write_gguf(folder, path, arch: str, tokenizer_json: str, expert_qtype=None) -> None:
    """The HF folder as llama.cpp's convert_hf_to_gguf.py writes it: metadata keys and tensor names of `arch` (names
    from the gguf package's own HF -> GGUF table), q/k rows permuted for "llama", each layer's experts stacked into
    one 3-D tensor [experts, out, in], F32 (the experts in `expert_qtype` if given); the tokenizer as a gpt2 BPE
    vocabulary."""
    import gguf
    from safetensors.torch import load_file

    from tests.model.test_loader import llamacpp_permute

    cfg = json.loads((folder / "config.json").read_text())
    weights = load_file(str(folder / "model.safetensors"))
    layers = cfg["num_hidden_layers"]
    names = gguf.get_tensor_name_map(next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch), layers)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    heads = {"q_proj": cfg["num_attention_heads"], "k_proj": cfg["num_key_value_heads"]}
    if cfg.get("head_dim"):
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    if "num_local_experts" in cfg:
        w.add_expert_count(cfg["num_local_experts"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        if "moe_intermediate_size" in cfg:  # Mixtral's experts are feed_forward_length wide
            w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    tok = json.loads(tokenizer_json)
    vocab = tok["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]])
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_chat_template(CHAT_TEMPLATE)
    experts: dict[str, list] = {}
    for name, t in weights.items():
        base = name.removesuffix(".weight")
        m = re.fullmatch(r"(model\.layers\.\d+\.\w+\.experts)\.(\d+)\.(\w+)", base)
        if m:  # gathered per (layer, projection), in expert order
            experts.setdefault(f"{m[1]}.{m[3]}", []).append((int(m[2]), t))
            continue
        proj = base.rpartition(".")[2]
        if arch == "llama" and proj in heads:
            t = torch.from_numpy(llamacpp_permute(t.numpy(), heads[proj]))
        w.add_tensor(names.get_name(base) + ".weight", t.numpy())
    for base, per_expert in experts.items():
        stacked = torch.stack([t for _, t in sorted(per_expert, key=lambda e: e[0])]).numpy()
        gguf_name = names.get_name(base) + ".weight"
        if expert_qtype is None:
            w.add_tensor(gguf_name, stacked)
        else:
            w.add_tensor(gguf_name, gguf.quants.quantize(stacked, expert_qtype), raw_dtype=expert_qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize(
    "case,arch,expert_qtype",
    [
        ("qwen3-gqa2-headdim32-tied", "qwen3", None),
        ("qwen3moe-top2of4-allsparse", "qwen3moe", None),
        ("qwen3moe-top2of4-allsparse", "qwen3moe", "Q8_0"),
        ("mixtral-top2of4", "llama", None),  # llama.cpp writes Mixtral as "llama" with experts, q/k permuted
    ],
)
def test_tiny_gguf_loads_as_its_hf_folder(case, arch, expert_qtype, tmp_path, tokenizer_json, monkeypatch):
    """llama.cpp's names for Qwen3 and Qwen3-MoE (q/k norms; the router; stacked 3-D experts, quantized too): the
    GGUF loads to the HF folder's config and weights (the experts as the gguf package dequantizes them), and its
    logits equal transformers' on the HF folder."""
    import gguf

    monkeypatch.setattr(loader, "cache_dir", lambda: tmp_path / "cache")  # the conversion cache, not the C++ build
    folder = tmp_path / "hf"
    hf = build(case, folder, tokenizer_json)
    qtype = getattr(gguf.GGMLQuantizationType, expert_qtype) if expert_qtype else None
    write_gguf(folder, tmp_path / "tiny.gguf", arch, tokenizer_json, qtype)
    ours, ref = load_model(str(tmp_path / "tiny.gguf")), load_model(str(folder))
    assert ours.config.rms_norm_eps == pytest.approx(ref.config.rms_norm_eps, rel=1e-6)  # GGUF keeps a float32
    assert dataclasses.replace(ours.config, rms_norm_eps=ref.config.rms_norm_eps) == ref.config
    assert set(ours.weights) == set(ref.weights)
    for name, want in ref.weights.items():
        if qtype is not None and ".experts." in name:
            want = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(want.numpy(), qtype), qtype))
        assert torch.equal(ours.weights[name], want), name
    if expert_qtype:
        return
    ids = torch.randint(0, VOCAB, (37,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.inference_mode():
        want = hf(torch.tensor([ids])).logits[0]
        # and written back out as an HF folder (what the bench's peers read), transformers computes the same
        exported = transformers.AutoModelForCausalLM.from_pretrained(export_hf(ours, tmp_path / "export")).float()
        assert (exported(torch.tensor([ids])).logits[0] - want).abs().max().item() <= 1e-5
    model = LlamaModel(ours.config, ours.weights, ops)
    assert (forward_logits(model, ids, last_only=False) - want).abs().max().item() <= 1e-4
