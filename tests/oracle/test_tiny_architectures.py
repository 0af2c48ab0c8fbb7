"""A tiny randomly initialised model of each architecture (Llama, Qwen2, Mistral, Gemma 2, Gemma 3), saved as an HF
folder by transformers inside the test, loaded by our loader: logits and greedy tokens equal transformers' own."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the oracle needs the test extra")

from tokenizers import Tokenizer as HFTokenizer  # noqa: E402
from tokenizers import decoders, models, pre_tokenizers, trainers  # noqa: E402

from batchjob.engine.sampling_params import SamplingParams  # noqa: E402
from batchjob.model import cpu_ops as ops  # noqa: E402  (what the engine runs on a CPU)
from batchjob.model.gemma import GemmaModel  # noqa: E402
from batchjob.model.llama import LlamaModel  # noqa: E402
from batchjob.model.loader import load_model  # noqa: E402
from tests.conftest import forward_logits  # noqa: E402

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
}
LENGTHS = (5, 37, 100)
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
    config = getattr(transformers, cls_name)(**{**COMMON, **extra})
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
    assert c.rope_theta == rope.get("rope_theta", 10000.0)
    assert (c.rope_scaling or {}).get("rope_type") == (
        rope.get("rope_type") if rope.get("rope_type") != "default" else None
    )
    if c.attention_bias:
        assert loaded.weights["model.layers.0.self_attn.q_proj.bias"].abs().min() > 0
    # Our inverse frequencies are transformers' (llama3 / linear scaling included).
    hf_inv = hf.model.rotary_emb.inv_freq.double()
    assert torch.allclose(c.inv_freq(), hf_inv, rtol=1e-6, atol=0), (c.inv_freq(), hf_inv)

    ours = LlamaModel(c, loaded.weights, ops, loaded.rope_freqs)
    g = torch.Generator().manual_seed(len(case))
    for n in LENGTHS:
        ids = torch.randint(0, VOCAB, (n,), generator=g).tolist()
        with torch.inference_mode():
            ref = hf(torch.tensor([ids])).logits[0].float()
        assert ref[-1].std() > 0.3, "logits too flat to compare"
        diff = (forward_logits(ours, ids) - ref[-1]).abs().max().item()
        assert diff <= 1e-4, f"{case}, {n} tokens: last logits differ by {diff}"
        if n == LENGTHS[-1]:
            diff = (forward_logits(ours, ids, last_only=False) - ref).abs().max().item()
            assert diff <= 1e-4, f"{case}, {n} tokens: some position's logits differ by {diff}"


@pytest.mark.parametrize(
    "case", ["llama-mha-tied-llama3rope-sharded", "qwen2-gqa4-bias-tied", "mistral-gqa2-headdim32-linearrope-sharded"]
)
def test_tiny_model_greedy_generate_matches_transformers(case, tmp_path, tokenizer_json):
    """Our engine (prompts batched, paged KV, chunked decode) vs `generate` one prompt at a time, eos off."""
    from batchjob.engine.engine import Engine

    hf = build(case, tmp_path, tokenizer_json)
    engine = Engine(str(tmp_path), num_kv_blocks=64, device="cpu", dtype="float32", num_threads=1)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (3, 20, 45)]
    outs = engine.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    for ids, out in zip(prompts, outs):
        with torch.inference_mode():
            # An eos id outside the vocabulary never stops generation (min_new_tokens would mask eos logits).
            ref = hf.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=8,
                do_sample=False,
                eos_token_id=VOCAB + 5,
                pad_token_id=0,
            )
        assert out.finish_reason == "length"
        assert out.token_ids == ref[0, len(ids) :].tolist(), f"{case}, prompt of {len(ids)} tokens"


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
        with torch.inference_mode():
            # An eos id outside the vocabulary never stops generation (min_new_tokens would mask eos logits).
            ref = hf.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=10,
                do_sample=False,
                eos_token_id=VOCAB + 5,
                pad_token_id=0,
                output_logits=True,
                return_dict_in_generate=True,
            )
        assert out.token_ids == ref.sequences[0, len(ids) :].tolist(), f"{case}, prompt of {len(ids)} tokens"
        ref_logprobs = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(ref.logits, out.token_ids)]
        diff = max(abs(a.logprob - b) for a, b in zip(out.logprobs, ref_logprobs))
        assert diff <= 1e-4, f"{case}, prompt of {len(ids)} tokens: logprobs differ by {diff}"


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
