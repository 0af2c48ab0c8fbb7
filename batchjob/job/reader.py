"""Input rows from Parquet (in batches, lazily), JSONL and OpenAI Batch files (line by line).

A row that cannot be used (bad JSON, bad UTF-8, an unreadable Parquet page) comes out with `error` set, so the job
writes it as a failed row and goes on; an input that cannot be opened at all raises InputError before any work."""

from __future__ import annotations

import glob
import hashlib
import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from batchjob.job.openai_batch import RequestLineError, parse_request
from batchjob.job.spec import InputSpec, JobSpec

MAX_LISTED_DUPLICATES = 5


class InputError(Exception):
    """The input cannot be used at all: no file, an unreadable file, missing columns, duplicate ids."""


@dataclass
class Row:
    index: int  # position in the whole input, stable across runs
    id: str
    values: dict[str, Any]  # the prompt's columns, or {"messages": ...} / {"prompt": ...} for OpenAI Batch lines
    passthrough: dict[str, Any] = field(default_factory=dict)
    overrides: dict[str, Any] = field(default_factory=dict)  # per-row sampling (OpenAI Batch lines)
    error: str | None = None


@dataclass
class Scan:
    total: int
    passthrough_schema: pa.Schema


class InputSource:
    def __init__(self, job: JobSpec):
        spec: InputSpec = job.input
        self.spec, self.format = spec, spec.format
        self.files = sorted(glob.glob(spec.path)) if glob.has_magic(spec.path) else [spec.path]
        if not self.files:
            raise InputError(f"input.path: no file matches {spec.path!r}")
        if self.format == "openai-batch":
            self.prompt_columns: list[str] = []
            self.passthrough = ["url", *[c for c in spec.passthrough if c != "url"]]
        else:
            self.prompt_columns = (
                [spec.messages_column] if spec.messages_column else sorted(set(job.prompt.fields) | {spec.text_column})
            )
            self.passthrough = list(spec.passthrough)
        self._parquet = {path: self._open_parquet(path) for path in self.files} if self.format == "parquet" else {}
        for path in self.files:
            if not Path(path).is_file():
                raise InputError(f"input.path: {path} is not a readable file")

    def _open_parquet(self, path: str) -> pq.ParquetFile:
        try:
            pf = pq.ParquetFile(path)
        except (OSError, pa.ArrowException) as e:
            raise InputError(f"cannot read {path} as Parquet: {e}") from None
        missing = [
            c for c in [self.spec.id_column, *self.prompt_columns, *self.passthrough] if c not in pf.schema_arrow.names
        ]
        if missing:
            raise InputError(
                f"{path}: no column {', '.join(map(repr, missing))}; it has {', '.join(pf.schema_arrow.names)}"
            )
        return pf

    def identity(self) -> list[dict]:
        """What the input is, for the job fingerprint: cheap to compute, and a copy or a touch leaves it alone."""
        out = []
        for path in self.files:
            size = Path(path).stat().st_size
            digest = hashlib.sha256()
            with open(path, "rb") as f:
                digest.update(f.read(1 << 16))
                f.seek(max(0, size - (1 << 16)))
                digest.update(f.read())
            out.append({"path": str(Path(path).resolve()), "size": size, "sha256_head_tail": digest.hexdigest()})
        return out

    def scan(self) -> Scan:
        """One cheap pass before any work: count rows, refuse duplicate ids, type the JSON pass-through columns."""
        counts: Counter[str] = Counter()
        kinds: dict[str, set[type]] = {c: set() for c in self.passthrough}
        total = 0
        if self.format == "parquet":
            for path, pf in self._parquet.items():
                for rg in range(pf.num_row_groups):
                    counts.update(self._row_group_ids(path, pf, rg, total))
                    total += pf.metadata.row_group(rg).num_rows
            schema = pa.unify_schemas(
                [pa.schema([pf.schema_arrow.field(c) for c in self.passthrough]) for pf in self._parquet.values()]
            )
        else:
            for path in self.files:
                try:
                    for row in self._json_rows(path, total):
                        counts[row.id] += 1
                        for c, v in row.passthrough.items():
                            if v is not None:
                                kinds[c].add(type(v))
                        total += 1
                except OSError as e:
                    raise InputError(f"cannot read {path}: {e.strerror or e}") from None
            schema = pa.schema([(c, _json_type(kinds[c])) for c in self.passthrough])
        duplicates = [i for i, n in counts.items() if n > 1]
        if duplicates:
            listed = ", ".join(repr(i) for i in duplicates[:MAX_LISTED_DUPLICATES])
            raise InputError(f"input: {len(duplicates)} duplicate ids (resume needs unique ids), e.g. {listed}")
        self.passthrough_schema = schema
        return Scan(total, schema)

    def rows(self) -> Iterator[Row]:
        """All rows in input order; scan() first, which types the JSON pass-through columns."""
        index = 0
        for path in self.files:
            if self.format == "parquet":
                yield from self._parquet_rows(path, self._parquet[path], index)
                index += self._parquet[path].metadata.num_rows
            else:
                for row in self._json_rows(path, index):
                    row.passthrough = {
                        c: _normalize(v, self.passthrough_schema.field(c).type) for c, v in row.passthrough.items()
                    }
                    yield row
                    index += 1

    # --- Parquet

    def _parquet_rows(self, path: str, pf: pq.ParquetFile, index: int) -> Iterator[Row]:
        columns = list(dict.fromkeys([self.spec.id_column, *self.prompt_columns, *self.passthrough]))
        for rg in range(pf.num_row_groups):
            n, done = pf.metadata.row_group(rg).num_rows, 0
            try:
                for batch in pf.iter_batches(self.spec.batch_rows, row_groups=[rg], columns=columns):
                    yield from self._batch_rows(path, batch, index + done)
                    done += batch.num_rows
            except (OSError, pa.ArrowException) as e:
                ids = self._row_group_ids(path, pf, rg, index)[done:]
                for k, row_id in enumerate(ids):
                    yield Row(index + done + k, row_id, {}, error=f"unreadable Parquet data in {path}: {e}")
            index += n

    def _row_group_ids(self, path: str, pf: pq.ParquetFile, rg: int, index: int) -> list[str]:
        """Ids of one row group, read in the same batches as the rows, so that a row group that breaks part-way
        gets the same ids in the scan and in the work pass; rows past the break get ids from their position."""
        ids: list[str] = []
        try:
            for batch in pf.iter_batches(self.spec.batch_rows, row_groups=[rg], columns=[self.spec.id_column]):
                ids += [
                    _synthetic_id(path, index + len(ids) + k) if v is None else str(v)
                    for k, v in enumerate(batch.column(0).to_pylist())
                ]
        except (OSError, pa.ArrowException):
            pass
        n = pf.metadata.row_group(rg).num_rows
        return ids + [_synthetic_id(path, index + k) for k in range(len(ids), n)]

    def _batch_rows(self, path: str, batch: pa.RecordBatch, index: int) -> Iterator[Row]:
        ids = batch.column(self.spec.id_column).to_pylist()
        errors: dict[int, str] = {}
        values = {c: _decode_column(batch.column(c), c, errors) for c in self.prompt_columns}
        passthrough = {c: batch.column(c).to_pylist() for c in self.passthrough}
        for i, raw_id in enumerate(ids):
            yield Row(
                index + i,
                _synthetic_id(path, index + i) if raw_id is None else str(raw_id),
                {c: v[i] for c, v in values.items()},
                {c: v[i] for c, v in passthrough.items()},
                error="the id is null" if raw_id is None else errors.get(i),
            )

    # --- JSONL and OpenAI Batch

    def _json_rows(self, path: str, index: int) -> Iterator[Row]:
        with open(path, "rb") as f:
            for lineno, raw in enumerate(f, start=1):
                if raw.strip():
                    yield self._json_row(path, lineno, raw, index)
                    index += 1

    def _json_row(self, path: str, lineno: int, raw: bytes, index: int) -> Row:
        synthetic = _synthetic_id(path, lineno, line=True)
        error = None
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            # Decode leniently to still find the id, so the failed row is written under it.
            text = raw.decode("utf-8", "replace")
            error = f"line {lineno} is not valid UTF-8 ({e.reason} at byte {e.start})"
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            return Row(index, synthetic, {}, error=f"malformed JSON on line {lineno}: {e.msg} at column {e.colno}")
        if not isinstance(obj, dict):
            return Row(index, synthetic, {}, error=f"line {lineno} is JSON {type(obj).__name__}, not an object")
        id_key = "custom_id" if self.format == "openai-batch" else self.spec.id_column
        raw_id = obj.get(id_key)
        if raw_id is None or isinstance(raw_id, (dict, list)):
            return Row(index, synthetic, {}, error=f"line {lineno}: {id_key} is missing, null or not a scalar")
        row = Row(index, str(raw_id), {}, {c: obj.get(c) for c in self.passthrough if c != "url"}, error=error)
        if self.format == "openai-batch":
            row.passthrough["url"] = obj.get("url")
            try:
                row.values, row.overrides = parse_request(obj)
            except RequestLineError as e:
                row.error = row.error or f"line {lineno}: {e}"
        else:
            row.values = {c: obj.get(c) for c in self.prompt_columns}
        return row


def _synthetic_id(path: str, n: int, line: bool = False) -> str:
    """An id for a row whose own id cannot be read: the file and its line (JSONL) or row number (Parquet)."""
    return f"{path}:{n}" if line else f"{path}#{n}"


def _decode_column(column: pa.Array, name: str, errors: dict[int, str]) -> list:
    # Strings are decoded here, value by value, so one bad value fails its row and not the batch.
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        return column.to_pylist()
    out = []
    for i, value in enumerate(column.cast(pa.large_binary()).to_pylist()):
        try:
            out.append(None if value is None else value.decode("utf-8"))
        except UnicodeDecodeError:
            out.append(None)
            errors[i] = f"column {name!r} is not valid UTF-8"
    return out


def _json_type(kinds: set[type]) -> pa.DataType:
    if kinds and kinds <= {bool}:
        return pa.bool_()
    if kinds and kinds <= {int}:
        return pa.int64()
    if kinds and kinds <= {int, float}:
        return pa.float64()
    return pa.string()  # strings, and anything mixed or nested as JSON text


def _normalize(value: Any, type_: pa.DataType) -> Any:
    if value is None:
        return None
    if type_ == pa.float64():
        return float(value)
    if type_ == pa.string() and not isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    return value
