"""The rows the model ran through each LoRA adapter (None: the base model) and how many of them failed:
_summary.json's this_run.lora. The local executor counts rows as they commit; each Ray worker counts its shard's and
the driver sums the shards it commits. Rows that fail before the model (an unknown adapter's name) are not here: they
count with the run's failed rows."""

from __future__ import annotations


class LoraCounts:
    def __init__(self) -> None:
        self.rows: dict[str | None, dict[str, int]] = {}

    def add(self, lora: str | None, rows: int, failed: bool) -> None:
        counts = self.rows.setdefault(lora, {"rows": 0, "failed": 0})
        counts["rows"] += rows
        counts["failed"] += rows if failed else 0

    def merge(self, summary: dict) -> None:
        """Add another count's summary() (a Ray shard's)."""
        for name, counts in [(None, summary["base_model"]), *summary["adapters"].items()]:
            if counts["rows"]:
                self.add(name, counts["rows"], False)
                self.rows[name]["failed"] += counts["failed"]

    def summary(self) -> dict | None:
        """{"base_model": {"rows", "failed"}, "adapters": {NAME: {"rows", "failed"}}}; None when nothing was counted."""
        return self._by_adapter(lambda counts: counts) if self.rows else None

    def rows_by_adapter(self) -> dict:
        """{"base_model": rows, "adapters": {NAME: rows}}: `plan`'s count, where no row has failed yet."""
        return self._by_adapter(lambda counts: counts["rows"])

    def _by_adapter(self, value) -> dict:
        adapters = {name: value(self.rows[name]) for name in sorted(n for n in self.rows if n is not None)}
        return {"base_model": value(self.rows.get(None, {"rows": 0, "failed": 0})), "adapters": adapters}
