"""Result rows into Parquet part files that are each whole or absent, and the final files made from them.

Locally a part is written under a hidden temporary name, fsynced, renamed into place and its folder fsynced; on an
object store it is one PUT under its final name (storage.py); either way, after a crash at any instant the folder
holds only complete parts, and the parts are the only record of which rows are done."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import BinaryIO

import pyarrow as pa
import pyarrow.compute as pc

from batchjob.job.input.openai_batch import format_response
from batchjob.job.output.lora_counts import LoraCounts
from batchjob.job.output.schema import CACHE_METADATA
from batchjob.job.output.state import StateError
from batchjob.job.output.storage import Location, display, parquet_file, read_parquet, write_atomic, write_table


class PartWriter:
    """Buffers result rows and commits them as a part every `checkpoint_rows` rows or `checkpoint_seconds`."""

    def __init__(
        self,
        folder: Location,
        schema: pa.Schema,  # the result rows' (schema.py); an embedding job sets it once the model is known
        *,
        checkpoint_rows: int,
        checkpoint_seconds: float,
        next_part: int,
        run_tag: str = "",
        before_commit: Callable[[], None] = lambda: None,
        count_lora: bool = False,  # a job with engine.lora: each part records its rows by adapter
    ):
        self.before_commit = before_commit
        self.folder, self.schema = folder, schema
        # On an object store a run's parts carry its tag: a run that lost its lease but still writes cannot
        # overwrite a part of the run that took over (there is no rename to lose a race cleanly).
        self.suffix = f"-{run_tag}" if run_tag else ""
        self.checkpoint_rows, self.checkpoint_seconds = checkpoint_rows, checkpoint_seconds
        self.next_part = next_part
        self.buffer: list[dict] = []
        self.cache_counts = {"hits": 0, "misses": 0}  # of the buffered rows, for the part's CACHE_METADATA
        self.count_lora = count_lora
        self.lora = LoraCounts()  # of the buffered rows, for the part's LORA_METADATA
        self.last_commit = time.monotonic()

    def add(self, record: dict, cache: str | None = None, *, model_ran: bool = False, lora: str | None = None) -> None:
        """Buffer a row; `cache` is "hits" for a row taken from the results cache, "misses" for one looked up there
        in vain and computed; `model_ran` for a row the model ran (or the results cache answered), through adapter
        `lora` (None: the base model)."""
        self.buffer.append(record)
        if cache is not None:
            self.cache_counts[cache] += 1
        if model_ran and self.count_lora:
            self.lora.add(lora, 1, record.get("error") is not None)
        if len(self.buffer) >= self.checkpoint_rows:
            self.flush()
        else:
            self.flush_if_due()

    def flush_if_due(self) -> None:
        if self.buffer and time.monotonic() - self.last_commit >= self.checkpoint_seconds:
            self.flush()

    def flush(self) -> None:
        if self.buffer:
            self.before_commit()
            table = pa.Table.from_pylist(self.buffer, schema=self.schema)
            metadata = {CACHE_METADATA: json.dumps(self.cache_counts)} if any(self.cache_counts.values()) else {}
            if self.count_lora:
                metadata |= self.lora.metadata()
            if metadata:
                table = table.replace_schema_metadata(metadata)
            write_table(self.folder / f"part-{self.next_part:06d}{self.suffix}.parquet", table)
            self.next_part += 1
            self.buffer = []
            self.cache_counts = {"hits": 0, "misses": 0}
            self.lora = LoraCounts()
        self.last_commit = time.monotonic()


def folder_schema(parts: list[Location], this_run: pa.Schema | None = None) -> pa.Schema:
    """The one schema of the dataset that `parts` make (with the rows of `this_run`'s schema): every column of any
    part, in the widest part's order (a part written before a column existed, an OpenAI Batch folder's prompt columns
    say, lacks it), without a part's own metadata. StateError when a column's types cannot be joined (a part written
    by another batchjob version): such a folder would never read as one dataset."""
    named = [(p.name, parquet_file(p).schema_arrow) for p in parts]
    named += [("this run", this_run)] if this_run is not None else []
    if not named:
        return pa.schema([])
    try:
        widest = sorted((schema for _, schema in named), key=len, reverse=True)
        return pa.unify_schemas(widest, promote_options="permissive").remove_metadata()
    except (pa.ArrowTypeError, pa.ArrowInvalid) as e:
        raise StateError(
            f"{display(parts[0].parent)}: {_conflict(named) or e}: its parts would not read as one dataset; "
            "--restart discards them and starts over"
        ) from None


def _conflict(named: list[tuple[str, pa.Schema]]) -> str | None:
    """The first column whose type in one schema does not join its type in an earlier one, and where each is."""
    first: dict[str, tuple[str, pa.Field]] = {}
    for where, schema in named:
        for field in schema:
            there, seen = first.setdefault(field.name, (where, field))
            try:
                pa.unify_schemas([pa.schema([seen]), pa.schema([field])], promote_options="permissive")
            except (pa.ArrowTypeError, pa.ArrowInvalid):
                return f"column {field.name}: {seen.type} in {there}, {field.type} in {where}"
    return None  # only the promoted types conflict; pyarrow's message says which


def conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """`table` with `schema`'s columns in its order (null where it lacks one), keeping its metadata."""
    columns = [
        table.column(f.name).cast(f.type) if f.name in table.column_names else pa.nulls(table.num_rows, f.type)
        for f in schema
    ]
    return pa.Table.from_arrays(columns, schema=schema.with_metadata(table.schema.metadata))


def conform_parts(parts: list[Location]) -> None:
    """Rewrite each part that lacks a column of the others (folder_schema), so that a reader of the folder that takes
    one file's schema (pq.read_table, polars) gets every column. Each rewrite is atomic and keeps the part's rows."""
    schema = folder_schema(parts)
    for part in parts:
        if not parquet_file(part).schema_arrow.remove_metadata().equals(schema):
            write_table(part, conform(read_parquet(part), schema))


def sort_parts(parts: list[Location], staging: Location, rows_per_file: int) -> None:
    """Write the rows of `parts` in input order as files of `rows_per_file` consecutive input rows, each with every
    column of any part (folder_schema).

    Each output file covers one range of row_index and reads only the parts whose row_index statistics overlap it;
    the sort window keeps each part's rows close together in the input, so memory stays near one output file."""
    schema = folder_schema(parts)
    ranges = [(_index_range(p), p) for p in parts]
    end = max((hi for (_, hi), _ in ranges), default=-1) + 1
    for number, start in enumerate(range(0, end, rows_per_file)):
        stop = start + rows_per_file
        pieces = [_rows_between(p, start, stop) for (lo, hi), p in ranges if lo < stop and hi >= start]
        pieces = [conform(t, schema) for t in pieces if t.num_rows]
        if pieces:
            # A part's cache counts are its own rows', not this file's (_summary.json keeps the totals).
            table = pa.concat_tables(pieces).sort_by("row_index").replace_schema_metadata(None)
            write_table(staging / f"sorted-{number:06d}.parquet", table)


def _index_range(part: Location) -> tuple[int, int]:
    meta = parquet_file(part).metadata
    # A leaf column's index: the list columns before row_index count one leaf per nested field.
    column = next(i for i in range(len(meta.schema)) if meta.schema.column(i).path == "row_index")
    lo, hi = None, None
    for rg in range(meta.num_row_groups):
        stats = meta.row_group(rg).column(column).statistics
        if stats is None or not stats.has_min_max:
            indexes = read_parquet(part, columns=["row_index"]).column(0)
            return pc.min(indexes).as_py(), pc.max(indexes).as_py()
        lo = stats.min if lo is None else min(lo, stats.min)
        hi = stats.max if hi is None else max(hi, stats.max)
    return (lo, hi) if lo is not None else (0, -1)


def _rows_between(part: Location, start: int, stop: int) -> pa.Table:
    table = read_parquet(part)
    index = table.column("row_index")
    return table.filter(pc.and_(pc.greater_equal(index, start), pc.less(index, stop)))


def iter_rows(files: list[Location]) -> Iterator[dict]:
    for path in files:
        for batch in parquet_file(path).iter_batches(1024):
            yield from batch.to_pylist()


def write_openai_output(files: list[Location], path: Location, model: str) -> None:
    def write(f: BinaryIO) -> None:
        for row in iter_rows(files):
            f.write(json.dumps(format_response(row, model), ensure_ascii=False).encode() + b"\n")

    write_atomic(path, write)
