"""Our Tokenizer on the real default model (SmolLM2-135M-Instruct's GGUF vocabulary): round trips, llama.cpp's
"smollm" digit split, special tokens, the chat template, and save/from_folder."""

from __future__ import annotations

import json

import pytest

from batchjob.model.loader import load_model
from batchjob.model.tokenizer import Tokenizer

TEXTS = [
    "Hello, world!",
    "naïve café — 東京 🤖 ok",
    "数字 12345 and emoji 👍🏽 end",
    "  two  spaces\n\ttab\r\n",
    "def f(x):\n    return x ** 2  # ünïcödé",
]
DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_model("smollm2-135m-instruct").tokenizer


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_round_trip(tok, text):
    ids = tok.encode(text)
    assert ids and all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
    assert tok.encode_batch([text, text]) == [ids, ids]


def test_no_bos_is_added(tok):
    # SmolLM2's GGUF says add_bos_token false: plain text encodes to its tokens only.
    assert tok.bos_token_id == 1 and tok.eos_token_id == 2
    assert tok.encode("Hi") == tok.encode("Hi", add_special_tokens=False) and 1 not in tok.encode("Hi")


@pytest.mark.parametrize("number", ["12345", "2024", "3.14159", "1000000"])
def test_digits_are_split_one_by_one(tok, number):
    ids = tok.encode(number)
    pieces = [tok.decode([i]) for i in ids]
    assert "".join(pieces) == number
    assert all(len(p) == 1 for p in pieces if p.isdigit() or any(ch.isdigit() for ch in p)), pieces
    assert len([p for p in pieces if p.isdigit()]) == sum(ch.isdigit() for ch in number)
    # Inside text too: "year 2024" has the four digits as four tokens.
    assert [tok.decode([i]) for i in tok.encode(f"year {number}")][-len(number) :] == list(number)


@pytest.mark.parametrize("special", ["<|im_start|>", "<|im_end|>", "<|endoftext|>"])
def test_special_tokens_encode_as_one_id(tok, special):
    (sid,) = tok.encode(special)
    assert tok.backend.token_to_id(special) == sid
    ids = tok.encode(f"a{special}b")
    assert sid in ids and len(ids) == 3
    assert tok.decode(ids) == "ab" and tok.decode(ids, skip_special_tokens=False) == f"a{special}b"


def test_chat_template_with_and_without_a_system_message(tok):
    user = [{"role": "user", "content": "Hi"}]
    text = tok.apply_chat_template(user)
    assert text == (
        f"<|im_start|>system\n{DEFAULT_SYSTEM}<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    with_system = [{"role": "system", "content": "Be brief."}] + user
    text = tok.apply_chat_template(with_system)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert DEFAULT_SYSTEM not in text
    assert not tok.apply_chat_template(with_system, add_generation_prompt=False).endswith("assistant\n")

    ids = tok.encode_chat(user)
    assert ids == tok.encode(tok.apply_chat_template(user), add_special_tokens=False)
    im_start, im_end = tok.encode("<|im_start|>")[0], tok.encode("<|im_end|>")[0]
    assert ids[0] == im_start and ids.count(im_start) == 3 and ids.count(im_end) == 2


def test_save_and_from_folder_round_trip(tok, tmp_path):
    tok.save(tmp_path)
    again = Tokenizer.from_folder(tmp_path)
    assert (again.bos_token_id, again.eos_token_id, again.vocab_size) == (
        tok.bos_token_id,
        tok.eos_token_id,
        tok.vocab_size,
    )
    assert again.chat_template == tok.chat_template
    for text in TEXTS + ["<|im_start|>user\n12345<|im_end|>"]:
        assert again.encode(text) == tok.encode(text)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Café 42?"}]
    assert again.encode_chat(msgs) == tok.encode_chat(msgs)


def test_no_chat_template_is_a_clear_error(tok, tmp_path):
    tok.save(tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": None}))
    plain = Tokenizer.from_folder(tmp_path)
    assert plain.encode("Hi there") == tok.encode("Hi there")
    with pytest.raises(ValueError, match="no chat template"):
        plain.apply_chat_template([{"role": "user", "content": "Hi"}])
    with pytest.raises(ValueError, match="no chat template"):  # the job layer says what to do about it
        plain.encode_chat([{"role": "user", "content": "Hi"}])
    assert plain.chat_template is None


QWEN3_LIKE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def test_chat_template_kwargs_reach_the_template_whole_and_by_shape(tok, tmp_path):
    """Qwen3's switch: `enable_thinking: false` writes an empty reasoning block into the prompt. A copy carries the
    kwargs (per-row rendering and the render-once-per-shape path alike); the tokenizer itself is left as it was."""
    tok.save(tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": QWEN3_LIKE}))
    plain = Tokenizer.from_folder(tmp_path)
    off = plain.with_template_kwargs({"enable_thinking": False})
    assert plain.with_template_kwargs({}) is plain
    chats = [([{"role": "user", "content": f"Question {i}?"}], 0) for i in range(3)]
    rendered = off.apply_chat_template(chats[0][0])
    assert rendered.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert plain.apply_chat_template(chats[0][0]).endswith("<|im_start|>assistant\n")
    by_shape = off.encode_chats(chats)
    assert by_shape == [off.encode(off.apply_chat_template(m), add_special_tokens=False) for m, _ in chats]
    assert plain.encode_chats(chats) != by_shape
    on = off.with_template_kwargs({"enable_thinking": True})
    assert on.apply_chat_template(chats[0][0]) == plain.apply_chat_template(chats[0][0])
