"""A row's images on a vision-language model: read from the image column (one image or a list of them) or from its
messages' image parts, and each `<image>` of its prompt expanded in token space, since the row's text is escaped and
the model's processor cannot read escaped text. The processor's expansion of a lone "<image>" is bounded by special
tokens, so splicing one over each of the prompt's image tokens, in order, gives the ids the processor gives the whole
prompt.

A row is read twice: when it is planned, for its expansions and its pixels' digests (the dedupe and results-cache keys
need them; the pixels are dropped at once, a sort window of them would not fit in memory), and again when its request
is streamed to the engine, for its pixels; a file that changed in between fails its row."""

from __future__ import annotations

import base64
import binascii
import dataclasses
import re
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import TYPE_CHECKING

from batchjob.job.contracts import JobEngine
from batchjob.job.input.parts import images_of, parse_messages
from batchjob.job.input.reader import Row
from batchjob.job.input.row_error import RowError
from batchjob.job.spec import JobFileError, JobSpec

if TYPE_CHECKING:  # the vision module imports torch, which the CLI loads with the model only
    from batchjob.model.vision.images import ImagePrompt, ImagePrompter

SCHEME = re.compile(r"([A-Za-z][\w+.-]*):")  # a URL's: then "//", but for data: and file:
DATA_URL = re.compile(r"data:image/[\w.+-]+;base64,", re.IGNORECASE)
URL_TIMEOUT_S = 30
MAX_URL_BYTES = 64 << 20  # an image fetched by URL: Pillow's bomb limit guards the pixels, this the download


@dataclass(frozen=True)
class RowImages:
    """The images of a planned row, in prompt order: what keys it and where their tokens lie."""

    # each image as read: encoded bytes (a cell's, a data URL's, a URL's download) or a local path, read again when
    # streamed; and its place in the row, for error messages
    sources: tuple[bytes | str, ...]
    names: tuple[str, ...]
    digests: tuple[bytes, ...]  # of the decoded pixels (images.digest): what keys the row apart from other images
    starts: tuple[int, ...]  # where each expansion begins in the work's token ids
    lengths: tuple[int, ...]  # each expansion's length
    firsts: tuple[int, ...]  # each image's first image token's position: the prefix cache keys the image from there
    prompter: ImagePrompter

    @property
    def tokens(self) -> int:
        return sum(self.lengths)

    def prompt(self, token_ids: list[int]) -> ImagePrompt:
        """The engine's input for the images in `token_ids` (the spliced prompt); RowError where an image no longer
        reads, or reads as another picture than the one planned."""
        import torch

        from batchjob.model.vision.images import ImageError

        made = []
        for source, name, digest, length in zip(self.sources, self.names, self.digests, self.lengths):
            try:
                one = self.prompter(self.prompter.image_token, [source])
            except ImageError as e:
                raise RowError(f"{name}: {e}") from None
            if one.digests[0] != digest or len(one.token_ids) != length:
                raise RowError(f"{name}: it changed since its row was planned (a file rewritten while the job ran)")
            made.append(one)
        return dataclasses.replace(
            made[0],
            token_ids=token_ids,
            pixel_values=torch.cat([m.pixel_values for m in made]),
            pixel_attention_mask=torch.cat([m.pixel_attention_mask for m in made]),
            positions=[p + start for m, start in zip(made, self.starts) for p in m.positions],
            image_starts=list(self.firsts),
            digests=list(self.digests),
        )


class ImageReader:
    """A job's images, for the model's processor: from input.image_column, or (without one) from the messages' image
    parts; JobFileError at once where the model reads text only."""

    def __init__(self, job: JobSpec, engine: JobEngine):
        self.column, self.allow_urls = job.input.image_column, job.input.allow_urls
        self.messages = job.input.messages_column or "messages"  # an OpenAI Batch line's are its row's "messages"
        prompter = engine.image_prompter
        if prompter is None:
            raise JobFileError(
                f"input.image_column: model {job.model} takes no images (it is not a vision-language model)"
            )
        self.prompter: ImagePrompter = prompter
        self.token, self.token_id = prompter.image_token, prompter.config.image_token_id

    def splice(self, row: Row, token_ids: list[int]) -> tuple[list[int], RowImages | None]:
        """The prompt's ids with each image token expanded into its image's tokens, in order; RowError where an image
        does not read or the prompt does not hold one image token for each image. None for a chat row without
        images."""
        from batchjob.model.vision.images import ImageError

        sources = self._sources(row)
        count = token_ids.count(self.token_id)
        if count != len(sources):
            raise RowError(
                f"the prompt holds {count} image tokens {self.token}, not the {len(sources)} its images take (the "
                "template's or its own, which prompt.on_too_long cuts away when it cuts the whole prompt)"
            )
        if not sources:
            return token_ids, None
        ids: list[int] = []
        digests, starts, lengths, firsts = [], [], [], []
        at = 0
        for source, where in sources:
            try:
                made = self.prompter(self.token, [source])
            except ImageError as e:
                raise RowError(f"{where}: {e}") from None
            token = token_ids.index(self.token_id, at)
            ids += token_ids[at:token]
            starts.append(len(ids))
            firsts.append(len(ids) + made.image_starts[0])
            ids += made.token_ids
            digests.append(made.digests[0])
            lengths.append(len(made.token_ids))
            at = token + 1
        ids += token_ids[at:]
        planned = RowImages(*map(tuple, zip(*sources)), *map(tuple, (digests, starts, lengths, firsts)), self.prompter)
        return ids, planned

    def _sources(self, row: Row) -> list[tuple[bytes | str, str]]:
        """Each of the row's images as bytes or a local path, with its place for error messages."""
        if self.column is None:
            if "prompt" in row.values:  # an OpenAI Batch /v1/completions line: a text prompt, no parts
                return []
            parts = images_of(parse_messages(row.values.get(self.messages)))
            return [(image_source(p.url, p.where, self.allow_urls), p.where) for p in parts]
        value = row.values.get(self.column)
        if value is None:
            raise RowError(f"missing image: {self.column} is missing or null")
        if isinstance(value, list):
            if not value:
                raise RowError(f"missing image: {self.column} is an empty list")
            named = [(v, f"{self.column}[{i}]") for i, v in enumerate(value)]
        else:
            named = [(value, self.column)]
        return [(image_source(v, where, self.allow_urls), where) for v, where in named]


def image_source(value, where: str, allow_urls: bool) -> bytes | str:
    """An image cell or an image part's URL as what the processor reads: encoded bytes (a cell's own, a data: URL's,
    or an http(s) URL's download where input.allow_urls is true) or a local path (as written, or a file:// URL's);
    RowError naming `where` otherwise. An image's bytes never become text."""
    if isinstance(value, bytes | bytearray):
        return bytes(value)
    if not isinstance(value, str) or not value:
        raise RowError(f"{where} must be image bytes, a local path or a URL, got {type(value).__name__}")
    m = SCHEME.match(value)
    scheme = m.group(1).lower() if m else ""
    if scheme not in ("data", "file") and not value[len(scheme) + 1 :].startswith("//"):
        scheme = ""  # no URL: a local path (a colon in a file name, a Windows drive)
    if scheme == "data":
        if not DATA_URL.match(value):
            raise RowError(f"{where}: a data URL must be data:image/...;base64,")
        try:
            return base64.b64decode(value[value.index(",") + 1 :], validate=True)
        except (binascii.Error, ValueError):
            raise RowError(f"{where}: the data URL's base64 does not decode") from None
    if scheme == "file":
        url = urllib.parse.urlparse(value)
        if url.netloc not in ("", "localhost"):
            raise RowError(f"{where}: a file:// URL names a local file (no host), got host {url.netloc!r}")
        return urllib.request.url2pathname(url.path)
    if scheme in ("http", "https"):
        if not allow_urls:
            raise RowError(f"{where}: an {scheme} URL is fetched only with input.allow_urls: true")
        return _fetch(value, where)
    if scheme:
        raise RowError(f"{where}: a {scheme}: URL is not read (data:, file://, http(s):// and local paths are)")
    return value


def _fetch(url: str, where: str) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=URL_TIMEOUT_S) as response:
            data = response.read(MAX_URL_BYTES + 1)
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise RowError(f"{where}: cannot fetch {url[:200]}: {getattr(e, 'reason', e)}") from None
    if len(data) > MAX_URL_BYTES:
        raise RowError(f"{where}: {url[:200]} is over {MAX_URL_BYTES >> 20} MiB")
    return data
