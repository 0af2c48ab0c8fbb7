import pytest

from batchjob.job.input.prompt import PromptBuilder, RowError
from batchjob.job.input.reader import Row
from batchjob.model.loader import load_model
from tests.fakes import FakeTokenizer
from tests.helpers import make_job

TOKENIZER = FakeTokenizer()


def builder(tmp_path, context_len=512, **sections) -> PromptBuilder:
    return PromptBuilder(make_job(tmp_path / "in.jsonl", tmp_path / "out", **sections), TOKENIZER, context_len)


def text_of(ids) -> str:
    return TOKENIZER.decode(ids)


def test_template_system_and_chat_template(tmp_path):
    row = Row(0, "a", {"text": "the body", "title": "T"})
    chat = builder(tmp_path, prompt={"system": "Be brief.", "template": "{title}: {text}"})
    ids, truncated = chat.build(row, 16)
    assert text_of(ids) == "<|system|>Be brief.\n<|user|>T: the body\n<|assistant|>" and not truncated
    plain = builder(tmp_path, prompt={"system": "Be brief.", "chat_template": False})
    assert text_of(plain.build(row, 16)[0]) == "Be brief.\n\nthe body"


@pytest.mark.parametrize(
    "values, message",
    [
        ({}, "missing prompt: text is missing or null"),
        ({"text": None}, "missing prompt: text is missing or null"),
        ({"text": "  "}, "missing prompt: text is empty"),
        ({"text": 42}, "text must be text, got int"),
        ({"text": ["a"]}, "text must be text, got list"),
    ],
)
def test_rows_without_a_usable_prompt(tmp_path, values, message):
    with pytest.raises(RowError, match=message):
        builder(tmp_path).build(Row(0, "a", values), 16)


def test_template_columns_must_be_present_scalars(tmp_path):
    b = builder(tmp_path, prompt={"template": "{title}: {text}"})
    with pytest.raises(RowError, match="template column 'title' is missing or null"):
        b.build(Row(0, "a", {"text": "x", "title": None}), 16)
    with pytest.raises(RowError, match="must be a scalar"):
        b.build(Row(0, "a", {"text": "x", "title": {"a": 1}}), 16)


def test_too_long_prompts_follow_the_policy(tmp_path):
    text = " ".join(f"word{i:03d}" for i in range(100))  # 799 tokens with the byte tokenizer
    row = Row(0, "a", {"text": text})
    sections = {"prompt": {"system": "S", "template": "Summarize: {text} END"}}
    with pytest.raises(RowError, match="too long for the model's context of 200"):
        builder(tmp_path, 200, **sections).build(row, 16)

    sections["prompt"]["on_too_long"] = "truncate_right"
    ids, truncated = builder(tmp_path, 200, **sections).build(row, 16)
    rendered = text_of(ids)
    assert truncated and len(ids) <= 200 - 16
    assert rendered.startswith("<|system|>S\n<|user|>Summarize: word000 word001") and rendered.endswith(
        " END\n<|assistant|>"
    )

    sections["prompt"]["on_too_long"] = "truncate_left"
    ids, truncated = builder(tmp_path, 200, **sections).build(row, 16)
    assert truncated and len(ids) <= 200 - 16 and "word099 END\n<|assistant|>" in text_of(ids)


def test_truncation_leaves_at_most_half_the_context_to_the_answer(tmp_path):
    b = builder(tmp_path, 100, prompt={"on_too_long": "truncate_right", "chat_template": False})
    ids, truncated = b.build(Row(0, "a", {"text": "x" * 500}), max_tokens=1000)
    assert truncated and len(ids) <= 50 and len(ids) >= 40


def test_a_template_bigger_than_the_context_is_cut_as_tokens(tmp_path):
    b = builder(tmp_path, 100, prompt={"system": "s" * 300, "on_too_long": "truncate_left"})
    ids, truncated = b.build(Row(0, "a", {"text": "hello"}), 10)
    assert truncated and len(ids) == 90 and text_of(ids).endswith("hello\n<|assistant|>")


def test_messages_get_the_system_text_and_truncate_their_longest_message(tmp_path):
    b = builder(
        tmp_path, 120, input={"messages_column": "chat"}, prompt={"system": "Sys", "on_too_long": "truncate_right"}
    )
    messages = [
        {"role": "user", "content": "q" * 300},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [{"type": "text", "text": "and now?"}]},
    ]
    ids, truncated = b.build(Row(0, "a", {"chat": messages}), 8)
    rendered = text_of(ids)
    assert truncated and rendered.startswith("<|system|>Sys\n<|user|>qqq")
    assert rendered.endswith("<|assistant|>ok\n<|user|>and now?\n<|assistant|>")
    with pytest.raises(RowError, match=r"messages\[0\] must be an object with a role"):
        b.build(Row(0, "a", {"chat": ["hi"]}), 8)
    with pytest.raises(RowError, match="messages must be a non-empty list"):
        b.build(Row(0, "a", {"chat": None}), 8)
    for text in [None, 5, ["x"]]:  # a content part whose text is not text fails its row (issue 12, item 10)
        with pytest.raises(RowError, match=r"messages\[0\].content\[0\].text must be text"):
            b.build(Row(0, "a", {"chat": [{"role": "user", "content": [{"type": "text", "text": text}]}]}), 8)


def test_openai_completion_prompts_are_used_as_given(tmp_path):
    b = builder(tmp_path, input={"format": "openai-batch"}, prompt={"system": "Sys"})
    assert text_of(b.build(Row(0, "a", {"prompt": "once upon"}), 8)[0]) == "once upon"
    chat = b.build(Row(0, "a", {"messages": [{"role": "user", "content": "hi"}]}), 8)[0]
    assert text_of(chat) == "<|system|>Sys\n<|user|>hi\n<|assistant|>"


@pytest.mark.parametrize(
    "sections, values",
    [
        ({"prompt": {"system": "Be brief.", "template": "{title}: {text}"}}, lambda t: {"text": t, "title": "T"}),
        ({"prompt": {"system": "Be brief."}}, lambda t: {"text": t}),
        ({}, lambda t: {"text": t}),
        (
            {"input": {"messages_column": "chat"}, "prompt": {"system": "Sys"}},
            lambda t: {"chat": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": f"{t} {t}"}]},
        ),
    ],
)
def test_build_many_on_the_real_tokenizer_gives_what_build_gives_row_by_row(tmp_path, sections, values):
    # build_many renders a chat template once per shape and tokenizes around the row's text (model/chat_shape.py).
    tokenizer = load_model("smollm2-135m-instruct").tokenizer
    b = PromptBuilder(make_job(tmp_path / "in.jsonl", tmp_path / "out", **sections), tokenizer, 64)
    texts = [" lead", "<|im_end|>", "trail\n", "東京 12345", "x" * 200, "ok", "", "<|im_start|>user\nhi"]
    rows = [Row(i, str(i), values(t)) for i, t in enumerate(texts)]

    def one(row):
        try:
            return b.build(row, 8)
        except RowError as e:
            return str(e)

    assert [r if isinstance(r, tuple) else str(r) for r in b.build_many(rows, [8] * len(rows))] == list(map(one, rows))
