"""Our tokenizer, forward pass and greedy decoding against Hugging Face transformers on the same GGUF weights."""

from __future__ import annotations

import pytest

from batchjob.engine.sampling_params import SamplingParams
from batchjob.model import cpu_ops as ops  # what the engine runs on a CPU
from batchjob.model.llama import LlamaModel
from tests.conftest import forward_logits, hf_generate


def _hf_ids(hf_tokenizer, messages) -> list[int]:
    out = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_prompt_lengths_span_the_range(loaded, oracle_prompts):
    lengths = [len(loaded.tokenizer.encode_chat(m)) for m in oracle_prompts]
    assert len(lengths) >= 16 and min(lengths) <= 40 and 1000 <= max(lengths) <= 1500


def test_token_ids_equal_transformers(loaded, hf_oracle, oracle_prompts):
    _, hf_tok = hf_oracle
    for messages in oracle_prompts:
        assert loaded.tokenizer.encode_chat(messages) == _hf_ids(hf_tok, messages)
        text = messages[-1]["content"]
        assert loaded.tokenizer.encode(text) == hf_tok.encode(text, add_special_tokens=True)


def test_chat_template_text_equals_transformers(loaded, hf_oracle):
    _, hf_tok = hf_oracle
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Café, naïve — 東京?"},
    ]
    for gen in (True, False):
        ours = loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=gen)
        assert ours == hf_tok.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False)


def test_logits_and_greedy_continuation_match_transformers(loaded, engine, hf_oracle, oracle_prompts):
    """Last-position logits within 1e-3, and 32 greedy tokens equal to `generate`'s: all 16 prompts batched
    together through our engine, each one alone through transformers."""
    hf_model, _ = hf_oracle
    model = LlamaModel(loaded.config, loaded.weights, ops, loaded.rope_freqs)
    prompts = [engine.tokenizer.encode_chat(m) for m in oracle_prompts]
    outs = engine.generate(prompts, SamplingParams(max_tokens=32))
    for ids, out in zip(prompts, outs):
        ref = hf_generate(hf_model, ids, 32, 2, return_dict_in_generate=True, output_logits=True)
        diff = (forward_logits(model, ids) - ref.logits[0][0].float()).abs().max().item()
        assert diff <= 1e-3, f"prompt of {len(ids)} tokens: logits differ by {diff}"
        assert out.token_ids == ref.sequences[0, len(ids) :].tolist(), f"prompt of {len(ids)} tokens"


@pytest.mark.parametrize("text", ["naïve café 東京 🤖 ok", "数字 12345 and emoji 👍🏽 end"])
def test_incremental_detokenization_handles_multibyte(engine, text):
    """Stream a multi-byte text's tokens through the engine's incremental detokenizer: the result must equal a
    full decode, with no replacement characters from split byte sequences."""
    from batchjob.engine.outputs import Request
    from batchjob.engine.sequence import Sequence

    ids = engine.tokenizer.encode(text)
    seq = Sequence(Request("x", [1], SamplingParams()), 0)
    for t in ids:
        seq.token_ids.append(t)
        seq.detokenize(engine.tokenizer)
    assert seq.text == engine.tokenizer.decode(ids) == text


def test_greedy_under_preemption_and_chunked_prefill_matches_transformers(hf_oracle, oracle_prompts):
    """A pool too small for the batch (preemption and recompute) and a token budget smaller than a prompt (prefill
    in chunks, sharing steps with decodes): each sequence still equals transformers' fp32 greedy, token for token."""
    from batchjob.engine.engine import Engine

    hf_model, _ = hf_oracle
    budget = 32
    engine = Engine(
        "smollm2-135m-instruct",
        dtype="float32",  # the exact mode: equal to transformers fp32
        num_kv_blocks=16,
        max_num_batched_tokens=budget,
        kv_watermark=1.0,
        enable_prefix_caching=False,  # a preempted sequence recomputes its every token
    )
    prompts = [engine.tokenizer.encode_chat(m) for m in oracle_prompts[:6]]  # 4 questions, 2 documents
    need = sum(-(-(len(p) + 16) // engine.config.block_size) for p in prompts)
    assert need > 2 * engine.num_kv_blocks and max(len(p) for p in prompts) > 4 * budget
    steps = []
    engine.add_step_callback(steps.append)
    outs = engine.generate(prompts, SamplingParams(max_tokens=16), use_tqdm=False)
    assert sum(s.num_preemptions for s in steps) > 0
    assert any(s.num_prefill_tokens and s.num_decode_tokens for s in steps)  # decode mixed into a prefill step
    assert all(s.num_prefill_tokens + s.num_decode_tokens <= budget for s in steps)
    for ids, out in zip(prompts, outs):
        ref = hf_generate(hf_model, ids, 16, 2)
        assert out.token_ids == ref[0, len(ids) :].tolist(), f"prompt of {len(ids)} tokens"
