"""Chat messages as a row gives them (a messages column, an OpenAI Batch chat line), their content a text or a list
of OpenAI content parts: `text` (and an assistant's `refusal`, as vLLM reads it) and `image_url`. One reading of the
parts serves both the prompt (where each image goes) and the images themselves (input/images.py), so the two cannot
disagree on which image is which."""

from __future__ import annotations

from dataclasses import dataclass

from batchjob.job.input.row_error import RowError

# The text of each content part, by type: OpenAI's text, and an assistant's refusal as vLLM reads it.
TEXT_PARTS = {"text": "text", "refusal": "refusal"}


@dataclass(frozen=True)
class ImagePart:
    url: str  # a data: URL, a local path, a file:// URL or an http(s) URL, as the row gives it (input/images.py)
    where: str  # the part's place, messages[i].content[j], for error messages


@dataclass(frozen=True)
class Message:
    role: str
    pieces: list[str | ImagePart]  # the content's text pieces and images in order; one text for a text content
    text_only: bool  # a text content, not a list of parts


def parse_messages(value) -> list[Message]:
    """The row's messages; RowError where they are not a non-empty list of {role, content} or a part is unreadable."""
    if not isinstance(value, list) or not value:
        raise RowError("messages must be a non-empty list")
    out = []
    for i, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise RowError(f"messages[{i}] must be an object with a role")
        content = message.get("content")
        if isinstance(content, str):
            out.append(Message(message["role"], [content], True))
        elif isinstance(content, list):
            pieces = [_part(part, f"messages[{i}].content[{j}]") for j, part in enumerate(content)]
            out.append(Message(message["role"], pieces, False))
        else:
            raise RowError(f"messages[{i}].content must be text")
    return out


def images_of(messages: list[Message]) -> list[ImagePart]:
    """The messages' image parts in order: the order a chat template writes their image tokens."""
    return [p for m in messages for p in m.pieces if isinstance(p, ImagePart)]


def _part(part, name: str) -> str | ImagePart:
    """A content part's text or image; RowError for a part no model here reads (audio, a file), which would otherwise
    be answered as if it were not there, as OpenAI's API and vLLM refuse it."""
    if not isinstance(part, dict):
        raise RowError(f"{name} must be an object with a type")
    kind = part.get("type")
    if kind == "image_url":
        image = part.get("image_url")
        url = image.get("url") if isinstance(image, dict) else image  # vLLM takes the bare URL too
        if not isinstance(url, str) or not url:
            raise RowError(f"{name}.image_url.url must be a non-empty text (a data: URL, a path or a URL)")
        return ImagePart(url, name)
    if kind not in TEXT_PARTS:
        what = "has no type" if kind is None else f"is of type {kind!r}"
        raise RowError(f"{name} {what}: parts of type 'text' and 'image_url' are read")
    text = part.get(TEXT_PARTS[kind])
    if not isinstance(text, str):
        raise RowError(f"{name}.{TEXT_PARTS[kind]} must be text")
    return text
