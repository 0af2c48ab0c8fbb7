"""Where a job's files live: a local path, or an fsspec URL (s3://, gs://, hf://, ...) on an object store.

Local paths keep POSIX semantics (write to a temporary name, fsync, rename, fsync the folder). Object stores have no
rename and no fsync, but a PUT is atomic: an object is visible whole or not at all, and a writer killed mid-upload
leaves nothing (at most an unfinished multipart upload, which no listing shows). So there each file is written
directly under its final name, once. Credentials and endpoints come from the store's standard environment
(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL, GOOGLE_APPLICATION_CREDENTIALS, HF_TOKEN, ...) and from
`storage_options` in the job file."""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
from upath import UPath

# A folder or file: pathlib.Path locally, upath.UPath (the same API over fsspec) for a URL.
Location = Path | UPath


def is_url(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


def location(path: str, storage_options: dict[str, Any] | None = None) -> Location:
    if is_url(path):
        return UPath(path, **(storage_options or {}))
    return Path(path.removeprefix("file://"))


def is_remote(path: Location) -> bool:
    return isinstance(path, UPath)


def url_to_fs(path: str, storage_options: dict[str, Any] | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem and the path within it, for input files (a local path gets fsspec's local filesystem)."""
    return fsspec.core.url_to_fs(path, **(storage_options or {}) if is_url(path) else {})


def refresh(folder: Location) -> None:
    """Forget cached listings, so that a listing sees what other processes wrote since."""
    if is_remote(folder):
        folder.fs.invalidate_cache()


def parquet_file(path: Location) -> pq.ParquetFile:
    return pq.ParquetFile(path.path, filesystem=path.fs) if is_remote(path) else pq.ParquetFile(path)


def read_parquet(path: Location, **kwargs) -> Any:
    return pq.read_table(path.path, filesystem=path.fs, **kwargs) if is_remote(path) else pq.read_table(path, **kwargs)


def mtime(path: Location) -> float:
    return path.stat().st_mtime


def display(path: Location) -> str:
    """The location as a user wrote it: a URL, or an absolute local path."""
    return str(path) if is_remote(path) else os.path.abspath(path)


def put_whole(path: UPath, write: Callable[[BinaryIO], Any]) -> None:
    """Write an object in one go: uncommitted until `write` returns, thrown away if it raises."""
    f = path.fs.open(path.path, "wb", autocommit=False)
    try:
        write(f)
        f.close()
    except BaseException:
        f.discard()
        raise
    f.commit()


TMP_PREFIX = ".batchjob-"  # temporary files are named .batchjob-<name>.<random>.tmp; recover() removes only those


def write_atomic(path: Location, write: Callable[[BinaryIO], Any], durable: bool = True) -> None:
    """Write `path` whole or not at all. The temporary file is created new (O_EXCL) and never through a symlink, so a
    link planted in a shared folder cannot redirect the write; os.replace then swaps the name, not a link's target.
    Not `durable` (no fsync: milliseconds less a file): for a file that a reader checks, where a power loss may leave
    it empty or cut short."""
    if is_remote(path):
        put_whole(path, write)
        return
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: Location, obj: Any) -> None:
    write_atomic(path, lambda f: f.write(json.dumps(obj, indent=2).encode() + b"\n"))


def write_table(path: Location, table: pa.Table) -> None:
    write_atomic(path, lambda f: pq.write_table(table, f, compression="zstd"))
