"""The full-content sha256 of an input file, for the job fingerprint: any edit, a same-length one in the middle
included, changes it. Reading a large input again on every resume would be slow, so the digest is remembered under
the cache folder by what changes whenever the content does: size, mtime, ctime and inode locally (ETag or mtime on
an object store)."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from batchjob.job.output.storage import write_json
from batchjob.model.builtin import cache_dir

log = logging.getLogger(__name__)


def file_version(path: str, fs: Any = None) -> list:
    """What changes whenever a file's content does: device, inode, size, mtime and ctime locally (a replace gives
    another inode, an append another size, an edit another mtime, and another ctime even when its mtime is put back
    as `cp -p` or `rsync -a --inplace` do); size and ETag (or mtime) on an object store."""
    if fs is None:
        st = Path(path).stat()
        return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]
    fs.invalidate_cache(path)  # the listing cache would answer with what the file was
    info = fs.info(path)
    return [info.get("size"), str(info.get("ETag") or info.get("LastModified") or info.get("mtime") or "")]


def file_sha256(path: str, fs: Any = None) -> str:
    name = str(Path(path).resolve()) if fs is None else fs.unstrip_protocol(path)
    version = file_version(path, fs)
    memo = cache_dir() / "input-digests" / f"{hashlib.sha256(name.encode()).hexdigest()}.json"
    try:
        known = json.loads(memo.read_text())
        if known["version"] == version:
            return known["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    digest = hashlib.sha256()
    with fs.open(path, "rb") if fs else open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        write_json(memo, {"path": name, "version": version, "sha256": digest.hexdigest()})
    except OSError as e:  # the memo only saves reading the input again: a run goes on without it
        log.warning("cannot remember the input's digest in %s (%s); a resume reads the input again", memo.parent, e)
    return digest.hexdigest()
