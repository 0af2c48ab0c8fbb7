"""A row's prompt as token ids: template, system text, chat template, and the too-long policy."""

from __future__ import annotations

from collections.abc import Callable

from batchjob.job.contracts import Chat, Tokenizer
from batchjob.job.input.reader import Row
from batchjob.job.spec import JobFileError, JobSpec

# Re-encoding a cut text can merge or split tokens at the cut; a few spare tokens make the next try fit.
TRUNCATION_MARGIN = 4
TRUNCATION_TRIES = 4


class RowError(ValueError):
    """This row cannot become a request; the message goes into the output row's `error`."""


class PromptBuilder:
    def __init__(self, job: JobSpec, tokenizer: Tokenizer, context_len: int, image_token: str | None = None):
        self.prompt, self.format = job.prompt, job.input.format
        self.text_column, self.messages_column = job.input.text_column, job.input.messages_column
        kwargs = job.prompt.chat_template_kwargs
        self.tokenizer = tokenizer.with_template_kwargs(kwargs) if tokenizer is not None else None
        self.context_len = context_len
        self.fields = [name for name in job.prompt.fields if name != self.text_column]  # parsed once, not per row
        self.chat = job.prompt.chat_template and job.task != "embed"  # an embedding model reads plain text
        # A generation needs room for one token and is cut to leave room for its answer (max_tokens, at most half the
        # context); a scored continuation (`max_tokens` its length) must follow its prompt whole.
        self.scoring = job.task == "score"
        # Row data is text: its special-token strings never become tokens (the chat template's markup and the job
        # file's own text may hold them), nor do they form across a join. The job file's text and opted-in rows keep
        # their special tokens, but the escaper's own mark character stays a character everywhere. An embedding
        # job's text goes to the Embedder, whose tokenizer is not ours, as it is.
        if job.task == "embed":
            self.data = self.text_of_job = lambda text: text
        else:
            self.data = lambda text: self.tokenizer.escape(text, not job.prompt.special_tokens_in_data)
            self.text_of_job = lambda text: self.tokenizer.escape(text, special_tokens=False)
        self.template, self.system = map(self.text_of_job, (job.prompt.template or "", job.prompt.system or ""))
        # A row's image (input/images.py) goes where the template writes its image token, else before the row's text.
        self.image_lead = image_token if image_token and image_token not in (job.prompt.template or "") else ""

    def build_many(self, rows: list[Row], max_tokens: list[int]) -> list[tuple[list[int], bool] | RowError]:
        """build() of many rows at once: one batch call to the tokenizer (parallel in its Rust threads), and chat
        prompts of one shape rendered once (Tokenizer.encode_chats), which is most of the cost of planning a large
        input; the prompts that come out too long go through build(); a row's RowError in its place."""
        out: list = [None] * len(rows)
        plain: list[tuple[int, str]] = []
        chats: list[tuple[int, Chat]] = []
        for i, row in enumerate(rows):
            try:
                compose, main = self._parts(row)
                prompt = compose(main)
            except RowError as e:
                out[i] = e
                continue
            if isinstance(prompt, str):
                plain.append((i, prompt))
            else:
                chats.append((i, prompt))
        for (i, _), ids in zip(plain, self.tokenizer.encode_batch([t for _, t in plain])):
            out[i] = ids
        for (i, _), ids in zip(chats, self.tokenizer.encode_chats([c for _, c in chats])):
            out[i] = _template_refused(ids) if isinstance(ids, Exception) else ids
        for i, built in enumerate(out):
            if isinstance(built, list):
                out[i] = (built, False)
                if not self._fits(len(built), max_tokens[i]):
                    try:
                        out[i] = self.build(rows[i], max_tokens[i])  # the too-long policy, row by row
                    except RowError as e:
                        out[i] = e
        return out

    def build(self, row: Row, max_tokens: int) -> tuple[list[int], bool]:
        """Token ids and whether they were truncated; RowError when the row has no usable prompt."""
        compose, main = self._parts(row)

        def encode(text: str) -> list[int]:
            prompt = compose(text)
            if isinstance(prompt, str):
                return self.tokenizer.encode(prompt)
            # A rendered chat template writes its own BOS, so the tokenizer must not add another.
            return self.tokenizer.encode(self._chat(prompt[0]), add_special_tokens=False)

        ids = full = encode(main)
        if self._fits(len(ids), max_tokens):
            return ids, False
        policy = self.prompt.on_too_long
        after = f" plus {max_tokens} to score after it" if self.scoring and max_tokens else ""
        if policy == "error":
            raise RowError(
                f"prompt is {len(ids)} tokens{after}, too long for the model's context of {self.context_len} "
                "(prompt.on_too_long: error)"
            )
        # Leave room for the answer too, but never give it more than half of the context.
        limit = self.context_len - (max_tokens if self.scoring else min(max_tokens, self.context_len // 2))
        if limit < 1:
            raise RowError(
                f"the continuation's {max_tokens} tokens leave no room for a prompt in the model's context of "
                f"{self.context_len}"
            )
        main_ids = self.tokenizer.encode(main, add_special_tokens=False)
        # Cut the row's own text rather than the whole prompt, so the system text and template survive.
        for _ in range(TRUNCATION_TRIES):
            over = len(ids) - limit
            if over <= 0:
                return ids, True
            keep = len(main_ids) - over - TRUNCATION_MARGIN
            if keep <= 0:
                break
            main_ids = main_ids[len(main_ids) - keep :] if policy == "truncate_left" else main_ids[:keep]
            ids = encode(self.data(self.tokenizer.decode(main_ids)))
        # Without its text the prompt would still be too long (a huge system text or message history): cut the
        # whole prompt's tokens, which keeps the row's text on the side the policy keeps.
        return (full[-limit:] if policy == "truncate_left" else full[:limit]), True

    def _fits(self, prompt_tokens: int, max_tokens: int) -> bool:
        if self.scoring:
            return prompt_tokens + max_tokens <= self.context_len
        return prompt_tokens < self.context_len

    def text(self, row: Row) -> str:
        """The whole prompt of a row as plain text (the template filled, no chat template), for a job whose model
        reads text: an embedding job's."""
        compose, main = self._parts(row)
        return compose(main)

    def _parts(self, row: Row) -> tuple[Callable[[str], str | Chat], str]:
        """How to compose the prompt around its main text (the part truncation cuts): a plain text, or a chat whose
        hole message holds it; and that text."""
        if self.format == "openai-batch":
            if "prompt" in row.values:  # a /v1/completions line: the prompt as given, no template
                return (lambda text: text), self.data(_text(row.values["prompt"], "body.prompt"))
            if self.tokenizer.chat_template is None:
                raise RowError(
                    "a /v1/chat/completions line needs a chat template, and this model has none "
                    "(a /v1/completions line with body.prompt needs none)"
                )
            return self._messages_parts(row.values["messages"])
        if self.messages_column:
            return self._messages_parts(row.values[self.messages_column])
        main = self.data(_text(row.values.get(self.text_column), self.text_column))
        fields = {name: self.data(_scalar(row.values.get(name), name)) for name in self.fields}
        template, system, chat, lead = self.template, self.system, self.chat, self.image_lead

        def compose(text: str) -> str | Chat:
            text = lead + text
            try:
                body = template.format_map({**fields, self.text_column: text}) if template else text
            except (ValueError, IndexError) as e:
                raise RowError(f"prompt.template cannot format this row: {e}") from None
            if chat:
                head = [{"role": "system", "content": system}] if system else []
                return head + [{"role": "user", "content": body}], len(head)
            return f"{system}\n\n{body}" if system else body

        return compose, main

    def _messages_parts(self, messages) -> tuple[Callable[[str], Chat], str]:
        messages = [{"role": self.data(m["role"]), "content": self.data(m["content"])} for m in _messages(messages)]
        if self.system and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": self.system})
        longest = max(range(len(messages)), key=lambda i: len(messages[i]["content"]))

        def compose(text: str) -> Chat:
            return [*messages[:longest], {**messages[longest], "content": text}, *messages[longest + 1 :]], longest

        return compose, messages[longest]["content"]

    def _chat(self, messages: list[dict]) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages)
        except Exception as e:  # the template is the model's code: some refuse some message orders, for one
            raise _template_refused(e) from None

    def check(self) -> str | None:
        """Fail before any work when every prompt is chat messages and the model has no chat template. A model
        without one (a base model) takes a text prompt as it is instead: the returned note says so. An OpenAI Batch
        file may hold /v1/completions lines only, which need none: there each chat line fails alone. (A template that
        refuses some messages fails those rows, not the job.)"""
        if not self.chat or self.tokenizer.chat_template is not None or self.format == "openai-batch":
            return None
        if self.messages_column:
            raise JobFileError("input.messages_column: chat messages need a chat template, and this model has none")
        self.chat = False
        return (
            "this model has no chat template (a base model): each prompt goes to it as plain text, the system text "
            "and the filled template (prompt.chat_template: false says so and silences this)"
        )


def _template_refused(e: Exception) -> RowError:
    return RowError(f"the model's chat template refused this prompt: {e}")


def _text(value, name: str) -> str:
    value = cell_text(value, name, "prompt")
    if not value.strip():
        raise RowError(f"missing prompt: {name} is empty")
    return value


def cell_text(value, name: str, what: str) -> str:
    """A cell's value as text; RowError naming the column where it is missing or not text (`what`: the prompt, the
    continuation)."""
    if value is None:
        raise RowError(f"missing {what}: {name} is missing or null")
    if isinstance(value, bytes):  # a Parquet BYTE_ARRAY column written without its UTF8 annotation
        try:
            value = value.decode()
        except UnicodeDecodeError as e:
            raise RowError(f"{name} is bytes that are not UTF-8 ({e})") from None
    if not isinstance(value, str):
        raise RowError(f"{name} must be text, got {type(value).__name__}")
    return value


def _scalar(value, name: str) -> str:
    if value is None:
        raise RowError(f"template column {name!r} is missing or null")
    if isinstance(value, (dict, list)):
        raise RowError(f"template column {name!r} must be a scalar, got {type(value).__name__}")
    return str(value)


def _messages(value) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise RowError("messages must be a non-empty list")
    out = []
    for i, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise RowError(f"messages[{i}] must be an object with a role")
        content = message.get("content")
        if isinstance(content, list):  # OpenAI content parts
            content = "".join(_text_part(part, f"messages[{i}].content[{j}]") for j, part in enumerate(content))
        if not isinstance(content, str):
            raise RowError(f"messages[{i}].content must be text")
        out.append({"role": message["role"], "content": content})
    return out


# The text of each content part a text model reads, by type: OpenAI's text, and an assistant's refusal as vLLM reads it.
TEXT_PARTS = {"text": "text", "refusal": "refusal"}


def _text_part(part, name: str) -> str:
    """A content part's text; RowError for a part a text model cannot read (an image, audio, a file), which would
    otherwise be answered as if it were not there, as OpenAI's API and vLLM refuse it."""
    if not isinstance(part, dict):
        raise RowError(f"{name} must be an object with a type")
    kind = part.get("type")
    if kind not in TEXT_PARTS:
        what = "has no type" if kind is None else f"is of type {kind!r}"
        raise RowError(f"{name} {what}: this model reads text only (parts of type 'text')")
    text = part.get(TEXT_PARTS[kind])
    if not isinstance(text, str):
        raise RowError(f"{name}.{TEXT_PARTS[kind]} must be text")
    return text


def shown(text: str, width: int = 40) -> str:
    """`text` as an error message quotes it: whole up to `width` characters, else its start and "..." (a label or a
    cell of a megabyte is not copied into every message)."""
    return text if len(text) <= width else f"{text[: width - 3]}..."
