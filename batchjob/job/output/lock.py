"""One run per output folder, by an flock on `_lock` that names its holder.

The kernel drops an flock when its process dies, kill -9 included, so a dead run's lock is free to take over with no
pid guessing and no race between two runs taking it at once. The file is emptied on release, and deleted only by a
run that leaves nothing else behind (`discard`): a run that takes the lock checks that the file it locked is still the
one at the path, so that a run that opened a file deleted since and a run that made a new one never both hold "the"
lock."""

from __future__ import annotations

import fcntl
import json
import os
import socket
import stat
from datetime import datetime, timezone
from pathlib import Path

from batchjob.job.output.storage import Location, is_remote


class LockHeld(Exception):
    def __init__(self, path: Path, holder: dict | None):
        self.holder = holder
        who = describe(holder) if holder else "an unknown process"
        super().__init__(f"{path.parent} is in use by another run: {who}")


def describe(holder: dict) -> str:
    return f"pid {holder.get('pid')} on {holder.get('host')}, started {holder.get('started')}"


def read_holder(path: Location) -> dict | None:
    try:
        if is_remote(path):  # an object store's lease object (lease.py)
            holder = json.loads(path.read_bytes())
        else:
            with os.fdopen(_open(path, os.O_RDONLY), "rb") as f:
                holder = json.loads(f.read(1 << 16))
    except (OSError, ValueError):  # absent, empty, partly written or not ours
        return None
    return holder if isinstance(holder, dict) else None


def _open(path: Path, flags: int) -> int:
    """Open the lock file itself, never a symlink planted in its place (another user could aim one at a file of the
    victim's, which acquiring would then empty), and only if it is a regular file."""
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(f"{path} is not a regular file")
    return fd


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path, follow_symlinks=False))
    except FileNotFoundError:
        return False


def lock_is_held(path: Path) -> bool:
    """Whether a run holds the lock now: asks the kernel's flock, so a dead holder whose pid was reused reads free."""
    try:
        fd = _open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops the shared lock, if taken
    return False


class OutputLock:
    def __init__(self, path: Path):
        self.path = path
        self.fd: int | None = None
        self.stale: dict | None = None  # a dead run's record, found and replaced on acquire

    def __enter__(self) -> OutputLock:
        while True:
            fd = _open(self.path, os.O_RDWR | os.O_CREAT)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise LockHeld(self.path, read_holder(self.path)) from None
            if _same_file(fd, self.path):
                break
            os.close(fd)  # its holder discarded it between our open and our flock: lock the file there now
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

    def discard(self) -> None:
        """Delete the lock file, still holding it (its folder is to go too); the release then only unlocks."""
        os.unlink(self.path)

    def __exit__(self, *exc) -> None:
        os.ftruncate(self.fd, 0)
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
        self.fd = None
