"""A row's prompt as token ids: template, system text, chat template, and the too-long policy."""

from __future__ import annotations

import functools
from collections.abc import Callable

from batchjob.job.contracts import Chat, Tokenizer
from batchjob.job.input.parts import ImagePart, Message, parse_messages
from batchjob.job.input.reader import Row
from batchjob.job.input.row_error import RowError
from batchjob.job.spec import JobFileError, JobSpec

# Re-encoding a cut text can merge or split tokens at the cut; a few spare tokens make the next try fit.
TRUNCATION_MARGIN = 4
TRUNCATION_TRIES = 4
# A content that a chat template writes as it is, where it reads a text content; none of a model's special tokens.
PROBE = "\ue000batchjob-probe\ue001"


class PromptBuilder:
    def __init__(
        self,
        job: JobSpec,
        tokenizer: Tokenizer,
        context_len: int,
        image_token: str | None = None,
        no_images: str | None = None,
    ):
        """`image_token`: a vision-language model's, where this job reads images (input/images.py); else an image
        part fails its row, `no_images` saying why after "... is an image" (default: the task reads none)."""
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
        # A row's images (input/images.py) go where the template writes image tokens, else all before the row's text.
        self.image_token, self.image_column = image_token, job.input.image_column
        self.image_lead = image_token if image_token and image_token not in (job.prompt.template or "") else ""
        self.no_images = no_images or f": task {job.task!r} reads none"

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
        template, system, chat = self.template, self.system, self.chat
        lead = self.image_lead * _image_count(row.values.get(self.image_column)) if self.image_lead else ""

        def compose(text: str) -> str | Chat:
            text = lead + text
            try:
                body = template.format_map({**fields, self.text_column: text}) if template else text
            except (ValueError, IndexError) as e:
                raise RowError(f"prompt.template cannot format this row: {e}") from None
            if chat:
                head = [{"role": "system", "content": self._content([system], True)}] if system else []
                return head + [{"role": "user", "content": self._content(self._split_images(body), True)}], len(head)
            return f"{system}\n\n{body}" if system else body

        return compose, main

    def _messages_parts(self, value) -> tuple[Callable[[str], Chat], str]:
        """A chat of the row's messages, their text escaped and each image part where it is; the longest text (a
        message's, or a part's) is the one truncation cuts."""
        messages = parse_messages(value)
        for m in messages:
            for p in m.pieces:
                if isinstance(p, ImagePart) and self.image_token is None:
                    raise RowError(f"{p.where} is an image{self.no_images}")
        messages = [
            Message(self.data(m.role), [p if isinstance(p, ImagePart) else self.data(p) for p in m.pieces], m.text_only)
            for m in messages
        ]
        if self.system and messages[0].role != "system":
            messages.insert(0, Message("system", [self.system], True))
        texts = [(i, j) for i, m in enumerate(messages) for j, p in enumerate(m.pieces) if isinstance(p, str)]
        # messages of images alone have no text to cut: their last is the chat's hole, its content as it is
        longest, at = max(texts, key=lambda ij: len(messages[ij[0]].pieces[ij[1]])) if texts else (-1, -1)

        def compose(text: str) -> Chat:
            chat = []
            for i, m in enumerate(messages):
                pieces = [*m.pieces[:at], text, *m.pieces[at + 1 :]] if i == longest else m.pieces
                chat.append({"role": m.role, "content": self._content(pieces, m.text_only)})
            return chat, longest % len(chat)

        return compose, messages[longest].pieces[at] if texts else ""

    def _content(self, pieces: list[str | ImagePart | None], text_only: bool) -> str | list[dict]:
        """A message's content as the chat template reads it: a text content as a text, its images' tokens in place,
        for a template that reads text; else (content parts, or a vision-language model's template that reads parts
        only: SmolVLM's) a list of `text` and `image` parts, as transformers' processor hands them to it. None, or an
        ImagePart, is an image."""
        if self.image_token is None or (text_only and self._reads_text_content):
            return "".join(p if isinstance(p, str) else self.image_token for p in pieces)
        return [{"type": "text", "text": p} if isinstance(p, str) else {"type": "image"} for p in pieces]

    def _split_images(self, body: str) -> list[str | None]:
        """A filled template's text and the image tokens in it (the job file's: the row's own are escaped), as pieces
        of a content; no empty text piece, which would be a part of its own."""
        if self.image_token is None:
            return [body]
        texts = body.split(self.image_token)
        pieces: list[str | None] = []
        for k, text in enumerate(texts):
            pieces += ([None] if k else []) + ([text] if text else [])
        return pieces

    @functools.cached_property
    def _reads_text_content(self) -> bool:
        """Whether the chat template writes a text content (most do); SmolVLM's writes only a list of parts."""
        try:
            return PROBE in self.tokenizer.apply_chat_template([{"role": "user", "content": PROBE}])
        except Exception:  # the template's own refusal: it reads no text content either
            return False

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


def _image_count(value) -> int:
    """How many images a row's image cell holds: a list's length, else one (input/images.py reads it, or fails it)."""
    return len(value) if isinstance(value, list) and value else 1


def shown(text: str, width: int = 40) -> str:
    """`text` as an error message quotes it: whole up to `width` characters, else its start and "..." (a label or a
    cell of a megabyte is not copied into every message)."""
    return text if len(text) <= width else f"{text[: width - 3]}..."
