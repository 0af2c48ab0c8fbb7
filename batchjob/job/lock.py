"""One run per output folder, by an flock on `_lock` that names its holder.

The kernel drops an flock when its process dies, kill -9 included, so a dead run's lock is free to take over with no
pid guessing and no race between two runs taking it at once. The file is never deleted, only emptied: deleting it
would let a run that opened the old file and a run that made a new one both hold "the" lock."""

from __future__ import annotations

import fcntl
import json
import os
import socket
from datetime import datetime, timezone
from pathlib import Path


class LockHeld(Exception):
    def __init__(self, path: Path, holder: dict | None):
        self.holder = holder
        who = describe(holder) if holder else "an unknown process"
        super().__init__(f"{path.parent} is in use by another run: {who}")


def describe(holder: dict) -> str:
    return f"pid {holder.get('pid')} on {holder.get('host')}, started {holder.get('started')}"


def read_holder(path: Path) -> dict | None:
    try:
        text = path.read_text()
    except OSError:
        return None
    try:
        holder = json.loads(text)
    except json.JSONDecodeError:
        return None
    return holder if isinstance(holder, dict) else None


def holder_alive(holder: dict) -> bool | None:
    """Whether the holder process still runs; None when it is on another host and cannot be asked."""
    if holder.get("host") != socket.gethostname():
        return None
    try:
        os.kill(int(holder["pid"]), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, KeyError, ValueError, TypeError):
        return True
    return True


class OutputLock:
    def __init__(self, path: Path):
        self.path = path
        self.fd: int | None = None
        self.stale: dict | None = None  # a dead run's record, found and replaced on acquire

    def __enter__(self) -> OutputLock:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise LockHeld(self.path, read_holder(self.path)) from None
        self.fd = fd
        self.stale = read_holder(self.path)
        me = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        os.fsync(fd)
        return self

    def __exit__(self, *exc) -> None:
        os.ftruncate(self.fd, 0)
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
        self.fd = None
