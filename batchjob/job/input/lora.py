"""Each row's LoRA adapter (engine.lora): the one its input.lora_column names, or an OpenAI Batch line's body.model
(vLLM's rule: a line naming an adapter gets it; one naming the job's model gets the base model; any other name fails
that line). Null or empty: the base model. A name the job does not know fails the row, not the job."""

from __future__ import annotations

from batchjob.job.input.prompt import RowError, shown
from batchjob.job.input.reader import Row
from batchjob.job.spec import JobSpec

OPENAI_MODEL = "model"  # the key under which the reader keeps an OpenAI Batch line's body.model


class RowLora:
    def __init__(self, job: JobSpec):
        self.adapters = sorted(job.engine.lora.adapters) if job.engine.lora else []
        self.openai = job.input.format == "openai-batch"
        self.key = OPENAI_MODEL if self.openai else job.input.lora_column
        self.model = job.model

    def of(self, row: Row) -> str | None:
        """The row's adapter name, None for the base model; RowError for a value that names no adapter."""
        if not self.adapters:
            return None
        value = row.values.get(self.key)
        if value is None or value == "" or self.openai and value == self.model:
            return None
        where = "body.model" if self.openai else self.key
        if not isinstance(value, str):
            raise RowError(f"{where}: a LoRA adapter's name is text, not {type(value).__name__}")
        if value not in self.adapters:
            base = f", or the job's model {self.model!r}" if self.openai else ""
            raise RowError(
                f"{where}: unknown LoRA adapter {shown(value)!r} (engine.lora.adapters names "
                f"{', '.join(map(repr, self.adapters))}{base})"
            )
        return value
