"""The rows the model ran through each LoRA adapter (None: the base model) and how many of them failed. Each part of a
job with engine.lora records its rows' count in its metadata (LORA_METADATA), so that `status` sums a folder's from
the parts' footers alone; _summary.json's `lora` holds the whole job's, its this_run.lora this run's. Rows that fail
before the model (an unknown adapter's name) are not here: they count with the failed rows only."""

from __future__ import annotations

import json

# A part's schema metadata: LoraCounts.counts() of its rows.
LORA_METADATA = b"batchjob.lora"


class LoraCounts:
    def __init__(self) -> None:
        self.rows: dict[str | None, dict[str, int]] = {}

    def add(self, lora: str | None, rows: int, failed: bool) -> None:
        self._add(lora, rows, rows if failed else 0)

    def _add(self, lora: str | None, rows: int, failed: int) -> None:
        counts = self.rows.setdefault(lora, {"rows": 0, "failed": 0})
        counts["rows"] += rows
        counts["failed"] += failed

    def merge(self, other: LoraCounts) -> None:
        for name, c in other.rows.items():
            self._add(name, c["rows"], c["failed"])

    @classmethod
    def from_metadata(cls, text: bytes) -> LoraCounts:
        """A part's LORA_METADATA, read back (so untrusted): ValueError where it is not counts() of counts."""
        parsed = cls()
        try:
            counts = json.loads(text)
            for name, c in [(None, counts["base_model"]), *counts["adapters"].items()]:
                rows, failed = c["rows"], c["failed"]
                if not all(type(n) is int and n >= 0 for n in (rows, failed)) or failed > rows:
                    raise ValueError(f"{name or 'base model'}: {c}")
                if rows:
                    parsed._add(name, rows, failed)
        except (TypeError, KeyError, AttributeError) as e:
            raise ValueError(f"its LoRA counts are not counts: {e!r}") from None
        return parsed

    def counts(self) -> dict:
        """{"base_model": {"rows", "failed"}, "adapters": {NAME: {"rows", "failed"}}}."""
        return self._by_adapter(lambda counts: counts)

    def summary(self) -> dict | None:
        """counts(); None when nothing was counted."""
        return self.counts() if self.rows else None

    def metadata(self) -> dict[bytes, str]:
        return {LORA_METADATA: json.dumps(self.counts())}

    def rows_by_adapter(self) -> dict:
        """{"base_model": rows, "adapters": {NAME: rows}}: `plan`'s count, where no row has failed yet."""
        return self._by_adapter(lambda counts: counts["rows"])

    def _by_adapter(self, value) -> dict:
        adapters = {name: value(self.rows[name]) for name in sorted(n for n in self.rows if n is not None)}
        return {"base_model": value(self.rows.get(None, {"rows": 0, "failed": 0})), "adapters": adapters}
