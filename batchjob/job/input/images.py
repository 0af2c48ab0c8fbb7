"""A row's image (input.image_column) on a vision-language model: the cell (encoded bytes or a local path) read and
its `<image>` expanded in token space, since the row's text is escaped and the model's processor cannot read escaped
text. The processor's expansion of a lone "<image>" is bounded by special tokens, so splicing it over the prompt's one
image token gives the ids the processor gives the whole prompt.

A row is read twice: when it is planned, for its expansion and its pixels' digest (the dedupe and results-cache keys
need it; the pixels are dropped at once, a sort window of them would not fit in memory), and again when its request
is streamed to the engine, for its pixels; a file that changed in between fails its row."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from batchjob.job.contracts import JobEngine
from batchjob.job.input.prompt import RowError
from batchjob.job.input.reader import Row
from batchjob.job.spec import JobFileError, JobSpec

if TYPE_CHECKING:  # the vision module imports torch, which the CLI loads with the model only
    from batchjob.model.vision.images import ImagePrompt, ImagePrompter


@dataclass(frozen=True)
class RowImage:
    source: bytes | str  # the cell: encoded bytes or a local path, read again when the request is streamed
    digest: bytes  # of the decoded pixels (images.digest): what keys the row apart from another image's
    start: int  # where its expansion begins in the work's token ids
    tokens: int  # the expansion's length
    first: int  # its first image token's position in the work's token ids: the prefix cache keys the image from there
    prompter: ImagePrompter

    def prompt(self, token_ids: list[int]) -> ImagePrompt:
        """The engine's input for the image in `token_ids` (the spliced prompt); RowError where the image no longer
        reads, or reads as another picture than the one planned."""
        from batchjob.model.vision.images import ImageError

        try:
            made = self.prompter(self.prompter.image_token, [self.source])
        except ImageError as e:
            raise RowError(f"image: {e}") from None
        if made.digests[0] != self.digest or len(made.token_ids) != self.tokens:
            raise RowError("image: it changed since its row was planned (a file rewritten while the job ran)")
        return dataclasses.replace(
            made,
            token_ids=token_ids,
            positions=[p + self.start for p in made.positions],
            image_starts=[s + self.start for s in made.image_starts],
        )


class RowImages:
    """The image column of a job, for the model's processor; JobFileError at once where the model reads text only."""

    def __init__(self, job: JobSpec, engine: JobEngine):
        self.column = job.input.image_column
        prompter = engine.image_prompter
        if prompter is None:
            raise JobFileError(
                f"input.image_column: model {job.model} takes no images (it is not a vision-language model)"
            )
        self.prompter: ImagePrompter = prompter
        self.token, self.token_id = prompter.image_token, prompter.config.image_token_id

    def splice(self, row: Row, token_ids: list[int]) -> tuple[list[int], RowImage]:
        """The prompt's ids with its one image token expanded into the row's image's tokens; RowError where the cell
        is no image or the prompt does not hold exactly one image token."""
        count = token_ids.count(self.token_id)
        if count != 1:
            raise RowError(
                f"the prompt holds {count} image tokens {self.token}, not the one its image takes (the template's "
                "or its own, which prompt.on_too_long cuts away when it cuts the whole prompt)"
            )
        from batchjob.model.vision.images import ImageError

        source = self._source(row.values.get(self.column))
        try:
            made = self.prompter(self.token, [source])
        except ImageError as e:
            raise RowError(f"{self.column}: {e}") from None
        at = token_ids.index(self.token_id)
        ids = token_ids[:at] + made.token_ids + token_ids[at + 1 :]
        first = at + made.image_starts[0]
        return ids, RowImage(source, made.digests[0], at, len(made.token_ids), first, self.prompter)

    def _source(self, value) -> bytes | str:
        if value is None:
            raise RowError(f"missing image: {self.column} is missing or null")
        if isinstance(value, bytes | bytearray):
            return bytes(value)
        if isinstance(value, str) and value:
            return value
        raise RowError(f"{self.column} must be image bytes or a local path, got {type(value).__name__}")
