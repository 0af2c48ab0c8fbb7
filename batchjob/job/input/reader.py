"""Input rows from Parquet (in batches, lazily), JSONL and OpenAI Batch files (line by line).

A row that cannot be used (bad JSON, bad UTF-8, an unreadable Parquet page) comes out with `error` set, so the job
writes it as a failed row and goes on; an input that cannot be opened at all raises InputError before any work.

The rows are read long after the digest that names them in the job's fingerprint (the model loads in between), so
each file's version (digest.file_version) is taken when the source is made and checked after the digest, around the
scan, whenever a file is opened, after its last row and on a read error, and (check_reading) before each commit of
results while a file is being read; a file that yields more or fewer rows than the scan counted has changed too. Any
change raises InputChanged: no row of other content is committed."""

from __future__ import annotations

import codecs
import glob
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from batchjob.job.input.openai_batch import RequestLineError, parse_request
from batchjob.job.output.digest import file_sha256, file_version
from batchjob.job.output.storage import is_url, url_to_fs
from batchjob.job.spec import InputSpec, JobSpec

MAX_LISTED_DUPLICATES = 5
ID_CHUNK = 1 << 16  # JSONL ids gathered this many at a time into Arrow
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# A JSON \uD800-\uDFFF escape: valid in a pair, but alone it decodes to a str that no tokenizer or writer can encode.
SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
LONE_SURROGATE = re.compile("[\ud800-\udfff]")


# The results cache's folder, a shard folder of it or what is in one (results_cache.py: DIR/<key[:2]>/<key>.json),
# relative to the cache folder.
CACHE_SHARD = re.compile(r"(?:[0-9a-f]{2}(?:/.*)?)?", re.DOTALL)


def _cache_entry(relative: str | None) -> bool:
    return relative is not None and CACHE_SHARD.fullmatch(relative) is not None


class InputError(Exception):
    """The input cannot be used at all: no file, an unreadable file, missing columns, duplicate ids."""


class InputChanged(InputError):
    """An input file changed (replaced, appended to, truncated, edited) while the job read it."""


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
    ids: pa.ChunkedArray  # every row's id by input position, in Arrow memory (not a Python object a row)


class InputSource:
    def __init__(self, job: JobSpec, versions: dict[str, list] | None = None):
        """`versions`: a driver's InputSource.versions, so that a Ray worker reads the files the driver found and
        digested, as they were then; default: input.path's files as they are now."""
        spec: InputSpec = job.input
        self.spec, self.format, self.task = spec, spec.format, job.task
        # A URL is read through fsspec (credentials and endpoint from the environment or input.storage_options);
        # a local path as it always was, so its synthetic ids and fingerprint stay the same.
        self.fs, root = url_to_fs(spec.path, spec.storage_options) if is_url(spec.path) else (None, spec.path)
        self.files = list(versions or ()) or self._list(root, job)
        if self.format == "openai-batch":
            self.prompt_columns: list[str] = []
            self.passthrough = ["url", *[c for c in spec.passthrough if c != "url"]]
        else:
            self.prompt_columns = (
                [spec.messages_column] if spec.messages_column else sorted(set(job.prompt.fields) | {spec.text_column})
            )
            continuation = job.score.continuation_column if job.task == "score" else None
            lora = spec.lora_column if job.engine.lora else None  # each row's adapter (input/lora.py)
            for column in (continuation, lora, spec.image_column):
                if column is not None and column not in self.prompt_columns:
                    self.prompt_columns.append(column)
            self.passthrough = list(spec.passthrough)
        self.lora = job.engine.lora is not None
        self.versions: dict[str, list] = dict(versions or {})
        self._scanned_rows: dict[str, int] = {}  # by file, what scan() counted
        self._reading: str | None = None  # the file rows() has open
        for path in self.files:
            if not (self.fs.isfile(path) if self.fs else Path(path).is_file()):
                raise InputError(f"input.path: {path} is not a readable file")
        # Each file's full name, however input.path spelled it: the URL with its scheme, or the resolved local path.
        # It names the file in the fingerprint and in the synthetic ids of rows whose id cannot be read.
        self.names = {p: self.fs.unstrip_protocol(p) if self.fs else str(Path(p).resolve()) for p in self.files}
        for path in self.files:
            self.check_unchanged(path)
        # Metadata only: a file is opened when it is read, so a glob may name more files than the open-file limit.
        self._parquet: dict[str, pq.FileMetaData] = {}
        self._passthrough_schemas: list[pa.Schema] = []
        if self.format == "parquet":
            for path in self.files:
                self._check_parquet(path)

    def check_unchanged(self, path: str) -> None:
        """Raise InputChanged if `path` is not the file it was when this source first looked at it."""
        try:
            now = file_version(path, self.fs)
        except FileNotFoundError:
            now = None
        if self.versions.setdefault(path, now) != now:
            raise self._changed(path)

    def check_reading(self) -> None:
        """check_unchanged for the file being read, if any: called before results are committed, so that rows read
        after an edit in place (same inode and size) cannot be committed before its last row shows the change."""
        if self._reading is not None:
            self.check_unchanged(self._reading)

    def _changed(self, path: str) -> InputChanged:
        return InputChanged(f"input changed during the run: {self.names[path]}")

    def _check_parquet(self, path: str) -> None:
        try:
            with pq.ParquetFile(path, filesystem=self.fs) as pf:
                metadata, schema = pf.metadata, pf.schema_arrow
        except (OSError, pa.ArrowException) as e:
            raise InputError(f"cannot read {path} as Parquet: {e}") from None
        missing = [c for c in [self.spec.id_column, *self.prompt_columns, *self.passthrough] if c not in schema.names]
        if missing:
            raise InputError(f"{path}: no column {', '.join(map(repr, missing))}; it has {', '.join(schema.names)}")
        self._parquet[path] = metadata
        self._passthrough_schemas.append(pa.schema([schema.field(c) for c in self.passthrough]))

    def _list(self, root: str, job: JobSpec) -> list[str]:
        """input.path's files, never one in the job's output folder: a glob that covers it would read the job's own
        files (its timeline, its parts) once a run has written them, and a file named inside it would be next to the
        folder's cleanup. Nor, of a glob's matches, the results cache's entries (its XX/ shard folders), for the same
        first reason; the cache folder may hold the input otherwise."""
        output = job.output.path
        in_output = self._relative_to(output, job.output.storage_options)
        in_cache = self._relative_to(job.cache.path, job.cache.storage_options) if job.cache else lambda path: None
        if not glob.has_magic(root):
            if in_output(root) is not None:
                raise InputError(
                    f"input.path: {root} is inside the output folder {output}; give output.path a folder of its own"
                )
            return [root]
        matches = sorted(self.fs.glob(root) if self.fs else glob.glob(root))
        files = [p for p in matches if in_output(p) is None and not _cache_entry(in_cache(p))]
        if not files:
            folders = f"the output folder {output}" + (f" and the results cache {job.cache.path}" if job.cache else "")
            outside = f" outside {folders}, which {'are' if job.cache else 'is'} never input" if matches else ""
            raise InputError(f"input.path: no file matches {self.spec.path!r}{outside}")
        return files

    def _relative_to(self, folder: str, options: dict[str, Any] | None) -> Callable[[str], str | None]:
        """An input path (as this source names it before `names`) relative to `folder`, "" for the folder itself;
        None for a path outside it."""
        if self.fs is None:
            if is_url(folder):
                return lambda path: None
            top = Path(folder.removeprefix("file://")).resolve()

            def relative(path: str) -> str | None:
                resolved = Path(path).resolve()
                return "/".join(resolved.relative_to(top).parts) if resolved.is_relative_to(top) else None

            return relative
        fs, top = url_to_fs(folder, options)
        if not is_url(folder) or fs.protocol != self.fs.protocol:
            return lambda path: None
        top = top.rstrip("/")
        return lambda path: "" if path == top else path[len(top) + 1 :] if path.startswith(f"{top}/") else None

    def identity(self) -> list[dict]:
        """What the input is, for the job fingerprint: its whole content (digest.py), so a copy or a touch leaves it
        alone and any edit does not."""
        out = []
        for path in self.files:
            size = self.fs.size(path) if self.fs else Path(path).stat().st_size
            out.append({"path": self.names[path], "size": size, "sha256": file_sha256(path, self.fs)})
            self.check_unchanged(path)  # the digest is of the file the rows will come from
        return out

    def _open(self, path: str) -> BinaryIO:
        return self.fs.open(path, "rb") if self.fs else open(path, "rb")

    def scan(self) -> Scan:
        """One cheap pass before any work: count rows, refuse duplicate ids, type the JSON pass-through columns."""
        chunks: list[pa.Array] = []
        kinds: dict[str, set[type]] = {c: set() for c in self.passthrough}
        total = 0
        if self.format == "parquet":
            for path, metadata in self._parquet.items():
                self.check_unchanged(path)
                with pq.ParquetFile(path, filesystem=self.fs) as pf:
                    for rg in range(metadata.num_row_groups):
                        chunks.append(pa.array(self._row_group_ids(path, pf, rg, total), pa.large_string()))
                        total += metadata.row_group(rg).num_rows
                self.check_unchanged(path)
            schema = self._parquet_passthrough_schema()
        else:
            pending: list[str] = []
            for path in self.files:
                first = total
                try:
                    for row in self._json_rows(path, total):
                        pending.append(row.id)
                        if len(pending) >= ID_CHUNK:
                            chunks.append(pa.array(pending, pa.large_string()))
                            pending = []
                        for c, v in row.passthrough.items():
                            if v is not None:
                                kinds[c].add(_kind(v))
                        total += 1
                except OSError as e:
                    raise InputError(f"cannot read {path}: {e.strerror or e}") from None
                self._scanned_rows[path] = total - first
            chunks.append(pa.array(pending, pa.large_string()))
            schema = pa.schema([(c, _json_type(kinds[c])) for c in self.passthrough])
        ids = pa.chunked_array(chunks, pa.large_string())
        series = pl.Series("id", ids)
        duplicates = series.filter(series.is_duplicated()).unique(maintain_order=True)
        if len(duplicates):
            listed = ", ".join(repr(i) for i in duplicates.head(MAX_LISTED_DUPLICATES).to_list())
            raise InputError(f"input: {len(duplicates)} duplicate ids (resume needs unique ids), e.g. {listed}")
        self.passthrough_schema = schema
        return Scan(total, schema, ids)

    def rows(self) -> Iterator[Row]:
        """All rows in input order; scan() first, which types the JSON pass-through columns."""
        if self.format == "parquet":
            yield from self.rows_between(0, sum(m.num_rows for m in self._parquet.values()))
            return
        index = 0
        for path in self.files:
            first, scanned = index, self._scanned_rows.get(path)
            for row in self._json_rows(path, index):
                if scanned is not None and index - first == scanned:  # a line past the scanned ones: appended
                    raise self._changed(path)
                row.passthrough = {
                    c: _normalize(v, self.passthrough_schema.field(c).type) for c, v in row.passthrough.items()
                }
                yield row
                index += 1
            if scanned is not None and index - first < scanned:  # fewer lines than scanned: truncated
                raise self._changed(path)

    def rows_between(self, start: int, stop: int) -> Iterator[Row]:
        """The Parquet rows at input positions start..stop-1, without converting the others (a Ray worker reads its
        shard so; a JSON line's position is known only by reading its file up to it)."""
        index = 0
        for path, metadata in self._parquet.items():
            if index < stop and start < index + metadata.num_rows:
                self.check_unchanged(path)
                self._reading = path
                with pq.ParquetFile(path, filesystem=self.fs) as pf:
                    yield from self._parquet_rows(path, pf, index, start, stop)
                self.check_unchanged(path)
                self._reading = None
            index += metadata.num_rows

    # --- Parquet

    def _parquet_passthrough_schema(self) -> pa.Schema:
        try:  # int32 in one file and int64 in another is fine; int64 and text is not
            return pa.unify_schemas(self._passthrough_schemas, promote_options="permissive")
        except (pa.ArrowException, ValueError) as e:
            raise InputError(
                f"input: the files' pass-through columns have types that do not fit together: {e}"
            ) from None

    def _parquet_rows(self, path: str, pf: pq.ParquetFile, index: int, start: int, stop: int) -> Iterator[Row]:
        columns = list(dict.fromkeys([self.spec.id_column, *self.prompt_columns, *self.passthrough]))
        for rg in range(pf.num_row_groups):
            n, done = pf.metadata.row_group(rg).num_rows, 0
            if start < index + n and index < stop:
                try:
                    for batch in pf.iter_batches(self.spec.batch_rows, row_groups=[rg], columns=columns):
                        lo, hi = max(start - index - done, 0), min(stop - index - done, batch.num_rows)
                        if lo < hi:
                            yield from self._batch_rows(path, batch.slice(lo, hi - lo), index + done + lo)
                        done += batch.num_rows
                        if index + done >= stop:
                            break
                except (OSError, pa.ArrowException) as e:
                    self.check_unchanged(path)  # a file that changed is not a damaged page: fail the job, not rows
                    ids = self._row_group_ids(path, pf, rg, index)
                    for k in range(max(done, start - index), min(n, stop - index)):
                        yield Row(index + k, ids[k], {}, error=f"unreadable Parquet data in {path}: {e}")
            index += n

    def _row_group_ids(self, path: str, pf: pq.ParquetFile, rg: int, index: int) -> list[str]:
        """Ids of one row group, read in the same batches as the rows, so that a row group that breaks part-way
        gets the same ids in the scan and in the work pass; rows past the break get ids from their position."""
        ids: list[str] = []
        try:
            for batch in pf.iter_batches(self.spec.batch_rows, row_groups=[rg], columns=[self.spec.id_column]):
                ids += _ids(self.names[path], batch.column(0), self.spec.id_column, index + len(ids), {})
        except (OSError, pa.ArrowException):
            pass
        n = pf.metadata.row_group(rg).num_rows
        return ids + [_synthetic_id(self.names[path], index + k) for k in range(len(ids), n)]

    def _batch_rows(self, path: str, batch: pa.RecordBatch, index: int) -> Iterator[Row]:
        errors: dict[int, str] = {}
        ids = _ids(self.names[path], batch.column(self.spec.id_column), self.spec.id_column, index, errors)
        values = {c: _decode_column(batch.column(c), c, errors) for c in self.prompt_columns}
        passthrough = {c: _decode_column(batch.column(c), c, errors) for c in self.passthrough}
        for i, row_id in enumerate(ids):
            yield Row(
                index + i,
                row_id,
                {c: v[i] for c, v in values.items()},
                {c: v[i] for c, v in passthrough.items()},
                error=errors.get(i),
            )

    # --- JSONL and OpenAI Batch

    def _json_rows(self, path: str, index: int) -> Iterator[Row]:
        self.check_unchanged(path)
        self._reading = path
        with self._open(path) as f:
            for lineno, raw in enumerate(f, start=1):
                if lineno == 1:
                    raw = raw.removeprefix(codecs.BOM_UTF8)  # written by some Windows tools; not part of the JSON
                if raw.strip():
                    yield self._json_row(path, lineno, raw, index)
                    index += 1
        self.check_unchanged(path)
        self._reading = None

    def _json_row(self, path: str, lineno: int, raw: bytes, index: int) -> Row:
        synthetic = _synthetic_id(self.names[path], lineno, line=True)
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
        except (RecursionError, ValueError) as e:  # nested too deep, or an integer with too many digits
            return Row(index, synthetic, {}, error=f"unusable JSON on line {lineno}: {str(e) or type(e).__name__}")
        if not isinstance(obj, dict):
            return Row(index, synthetic, {}, error=f"line {lineno} is JSON {type(obj).__name__}, not an object")
        if SURROGATE_ESCAPE.search(text) and not _encodable(obj):
            # As for bad UTF-8: each lone surrogate replaced, so the failed row is written under the line's id.
            obj = json.loads(LONE_SURROGATE.sub("\ufffd", json.dumps(obj, ensure_ascii=False)))
            error = error or f"line {lineno}: a \\u escape makes a lone surrogate, not text"
        id_key = "custom_id" if self.format == "openai-batch" else self.spec.id_column
        raw_id = obj.get(id_key)
        if raw_id is None or isinstance(raw_id, (dict, list)) or raw_id != raw_id:  # NaN is not equal to itself
            return Row(index, synthetic, {}, error=f"line {lineno}: {id_key} is missing, null, NaN or not a scalar")
        row = Row(index, str(raw_id), {}, {c: obj.get(c) for c in self.passthrough if c != "url"}, error=error)
        if self.format == "openai-batch":
            row.passthrough["url"] = obj.get("url")
            try:
                row.values, row.overrides = parse_request(obj, self.task)
            except RequestLineError as e:
                row.error = row.error or f"line {lineno}: {e}"
            if self.lora and isinstance(obj.get("body"), dict):  # the line's adapter, if it names one (input/lora.py)
                row.values["model"] = obj["body"].get("model")
        else:
            row.values = {c: obj.get(c) for c in self.prompt_columns}
        return row


def _encodable(obj: Any) -> bool:
    try:
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def _synthetic_id(name: str, n: int, line: bool = False) -> str:
    """An id for a row whose own id cannot be read: the file's full name (InputSource.names: with its scheme, or
    resolved, as in the fingerprint, so a resume that spells it otherwise finds the same ids) and its line (JSONL) or
    row number (Parquet)."""
    return f"{name}:{n}" if line else f"{name}#{n}"


def _ids(file: str, column: pa.Array, name: str, index: int, errors: dict[int, str]) -> list[str]:
    """The ids of a batch as text; a null, NaN or undecodable id gets a synthetic one and fails its row."""
    ids = []
    for i, value in enumerate(_decode_column(column, name, errors)):
        if value is None or value != value:  # NaN is not equal to itself
            errors.setdefault(i, "the id is null or NaN")
            ids.append(_synthetic_id(file, index + i))
        else:
            ids.append(str(value))
    return ids


def _decode_column(column: pa.Array, name: str, errors: dict[int, str]) -> list:
    # Values are converted one by one only when the whole column cannot be, so one bad value (invalid UTF-8 from a
    # writer that skipped validation, also inside a list or struct) fails its row and not the batch.
    try:
        return column.to_pylist()
    except UnicodeDecodeError:
        pass
    out = []
    for i in range(len(column)):
        try:
            out.append(column[i].as_py())
        except UnicodeDecodeError:
            out.append(None)
            errors.setdefault(i, f"column {name!r} is not valid UTF-8")
    return out


class _BigInt:
    """The kind of a JSON integer that int64 cannot hold: its column becomes text, which keeps every digit."""


def _kind(value: Any) -> type:
    if type(value) is int and not INT64_MIN <= value <= INT64_MAX:
        return _BigInt
    return type(value)


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
