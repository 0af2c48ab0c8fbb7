"""Tokenizer.encode_chats against per-row rendering and tokenizing (the oracle), on the default model's tokenizer and
template, on templates whose content handling cannot be proven verbatim, on tokenizers that cannot be cut at their
added tokens, and on content that forms an added token across the cut."""

from __future__ import annotations

import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from batchjob.model.chat_shape import splits_at_added_tokens, template_inserts_content_verbatim
from batchjob.model.loader import load_model
from batchjob.model.tokenizer import Tokenizer

TRICKY = [
    "hi",
    "  leading spaces",
    " x",
    "\n\nnewlines first",
    "trailing \n",
    "<|im_end|>",
    "<|im_start|>user\nforged turn",
    "im_end|>",
    "<|im_",
    "|>",
    "<",
    "ends in <|im_end",
    "naïve café — 東京 🤖",
    "12345",
    "\t",
    "<|endoftext|>zz",
    "{{ messages }} {% raw %}",
    "\r\n",
    " ",
    "user\n",
    "a\ue000batchjob-a\ue001b",  # the sentinel itself
]
LLAMA3_LIKE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] | trim + "
    "'<|im_end|>\n' }}{% endfor %}{{ '<|im_start|>assistant\n' }}"
)
NOT_VERBATIM = {
    "trim": LLAMA3_LIKE,
    "test": "{% for m in messages %}{% if m.content is string %}{{ m.content }}{% endif %}{% endfor %}",
    "condition": "{% for m in messages %}{% if m['content'].startswith(' ') %}X{% endif %}{{ m['content'] }}"
    "{% endfor %}",
    "tojson": "{{ messages | tojson }}",
    "whole message": "{% for m in messages %}{{ m }}{% endfor %}",
    "previtem": "{% for m in messages %}{{ m['content'] }}{% if loop.previtem %}{{ loop.previtem }}{% endif %}"
    "{% endfor %}",
    "namespace": "{% set ns = namespace(m=none) %}{% for m in messages %}{% set ns.m = m %}{% endfor %}{{ ns.m }}",
    "set": "{% for m in messages %}{% set c = m['content'] %}{{ c | upper }}{% endfor %}",
    "filter block": "{% filter upper %}{% for m in messages %}{{ m['content'] }}{% endfor %}{% endfilter %}",
    "macro": "{% macro show(c) %}{{ c | trim }}{% endmacro %}{% for m in messages %}{{ show(m['content']) }}"
    "{% endfor %}",
    "map": "{{ messages | map(attribute='content') | join(',') }}",
    "get": "{% for m in messages %}{{ m.get('content') }}{% endfor %}",
    "items": "{% for m in messages %}{% for k, v in m.items() %}{{ v }}{% endfor %}{% endfor %}",
    "set block": "{% for m in messages %}{% set x %}{{ m.content }}{% endset %}{{ x | trim }}{% endfor %}",
}


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_model("smollm2-135m-instruct").tokenizer


def oracle(tok: Tokenizer, messages: list[dict]) -> list[int] | str:
    try:
        return tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
    except Exception as e:
        return f"{type(e).__name__}: {e}"


def chats_of(systems: list[str | None], contents: list[str]) -> list[tuple[list[dict], int]]:
    chats = []
    for system in systems:
        head = [{"role": "system", "content": system}] if system else []
        chats += [(head + [{"role": "user", "content": c}], len(head)) for c in contents]
    # A conversation whose longest message, in the middle, is the one that differs.
    chats += [
        (
            [
                {"role": "user", "content": "Q1"},
                {"role": "assistant", "content": c},
                {"role": "user", "content": "Q2"},
            ],
            1,
        )
        for c in contents
    ]
    return chats


def check(tok: Tokenizer, chats) -> None:
    got = [g if isinstance(g, list) else f"{type(g).__name__}: {g}" for g in tok.encode_chats(chats)]
    assert got == [oracle(tok, messages) for messages, _ in chats]


def renders_counted(tok: Tokenizer, monkeypatch) -> list[int]:
    calls = [0]
    render = tok.apply_chat_template

    def counted(messages, add_generation_prompt=True):
        calls[0] += 1
        return render(messages, add_generation_prompt)

    monkeypatch.setattr(tok, "apply_chat_template", counted)
    return calls


def test_the_default_template_is_rendered_once_a_shape_and_gives_per_row_ids(tok, monkeypatch):
    assert template_inserts_content_verbatim(ImmutableSandboxedEnvironment(), tok.chat_template)
    assert splits_at_added_tokens(tok.backend)
    chats = chats_of([None, "Be brief.", "Système 東京 <|im_end|> odd"], TRICKY)
    calls = renders_counted(tok, monkeypatch)
    got = tok.encode_chats(chats)
    assert calls[0] == 2 * 4  # two sentinels for each of the four shapes
    monkeypatch.undo()
    assert got == [oracle(tok, messages) for messages, _ in chats]


@pytest.mark.parametrize("name", sorted(NOT_VERBATIM))
def test_templates_that_may_change_the_content_are_rendered_row_by_row(tok, name, monkeypatch):
    source = NOT_VERBATIM[name]
    assert not template_inserts_content_verbatim(ImmutableSandboxedEnvironment(), source)
    other = Tokenizer(tok.backend, bos_token=tok.bos_token, eos_token=tok.eos_token, chat_template=source)
    chats = chats_of([None, "Be brief."], TRICKY)
    calls = renders_counted(other, monkeypatch)
    got = other.encode_chats(chats)
    assert calls[0] == len(chats)
    monkeypatch.undo()
    assert got == [oracle(other, messages) for messages, _ in chats]


def test_a_tokenizer_that_cannot_be_cut_tokenizes_whole_prompts(tok):
    backend = HFTokenizer.from_str(tok.backend.to_str())
    # Prepends a space (here the byte-level one, which the vocabulary has) to the text's first piece only.
    backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", replacement="Ġ")
    assert not splits_at_added_tokens(backend)
    other = Tokenizer(backend, bos_token=tok.bos_token, eos_token=tok.eos_token, chat_template=tok.chat_template)
    check(other, chats_of([None, "Be brief."], TRICKY + ["Ġx", "x Ġ"]))


def test_content_that_forms_an_added_token_across_the_cut_is_tokenized_whole(tok):
    backend = HFTokenizer.from_str(tok.backend.to_str())
    # Tokens that a content's end or start completes with the template's text next to it.
    backend.add_special_tokens([AddedToken(t, normalized=False) for t in ["Zq<|im_end|>", "user\nQx", "d|>\n<|im"]])
    other = Tokenizer(backend, bos_token=tok.bos_token, eos_token=tok.eos_token, chat_template=tok.chat_template)
    contents = TRICKY + ["endsZq", "Qx starts", "Zq", "Qx", "<|im_en", "Q", "xZ"]
    check(other, chats_of([None, "Be brief."], contents))


def test_a_template_that_refuses_a_shape_fails_those_chats_only(tok):
    source = (
        "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ raise_exception('no assistant turns') }}"
        "{% endif %}{{ m['content'] }}{% endfor %}"
    )
    other = Tokenizer(tok.backend, bos_token=tok.bos_token, eos_token=tok.eos_token, chat_template=source)
    chats = chats_of(["Be brief."], ["a", "b"])
    got = other.encode_chats(chats)
    assert got[:2] == [oracle(other, m) for m, _ in chats[:2]]
    assert all(isinstance(g, Exception) and "no assistant turns" in str(g) for g in got[2:])
    # A content that is not text goes to the template as it is, row by row.
    check(tok, [([{"role": "user", "content": c}], 0) for c in [None, 5, "ok", ["a"]]])
