"""One run per output folder on an object store: a lease object that a live run renews.

Object stores have no flock, and no process there notices that a holder died, so the lock is `_lock` holding {pid,
host, started, token, expires}. A run takes it by a conditional create (S3's `If-None-Match: *`, through the fsspec
driver's exclusive-create mode): of two runs starting at once exactly one succeeds. While it runs, a thread rewrites
the lease every quarter of `lease_seconds` with a later expiry. A run killed with -9 stops renewing; once the lease
has expired the next run takes it over: first it claims that expired record by creating a marker named after the
record's digest (`_lock.takeover-<digest>`, the same conditional create), then deletes the lease and creates its own.
Of two runs that read the same expired record only the one that created the marker goes on, so a stalled run can
never delete a lease another run has just taken; the markers stay (a few bytes per takeover). A run that finds its
lease taken (it stalled past the expiry) stops committing (LeaseLost), and its parts carry its own tag, so it cannot
overwrite the parts of the run that took over. The guarantee therefore rests on clocks agreeing to well within
`lease_seconds` and on the store's conditional create; stores whose driver has no exclusive create are refused."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import socket
import threading
import time
from datetime import datetime, timezone

from upath import UPath

from batchjob.job.output.lock import LockHeld


class LeaseLost(Exception):
    """Another run took this run's lease: it must not commit anything more (exit code 75, as for a held lock)."""


def _holder(record: bytes | None) -> dict | None:
    if record is None:
        return None
    try:
        holder = json.loads(record)
    except ValueError:
        return {}  # unreadable: treated as expired
    return holder if isinstance(holder, dict) else {}


def lease_expired(holder: dict) -> bool:
    return float(holder.get("expires", 0)) <= time.time()


class LeaseLock:
    def __init__(self, path: UPath, lease_seconds: float):
        self.path, self.ttl = path, lease_seconds
        self.token = secrets.token_hex(4)
        self.stale: dict | None = None  # an expired lease, taken over on acquire
        self.lost = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.holder = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "token": self.token,
        }

    def _record(self) -> bytes:
        return json.dumps({**self.holder, "expires": time.time() + self.ttl}).encode()

    def _create(self) -> bool:
        try:
            self.path.fs.pipe_file(self.path.path, self._record(), mode="create")
        except FileExistsError:
            return False
        return True

    def _read_raw(self) -> bytes | None:
        try:
            return self.path.fs.cat_file(self.path.path)
        except FileNotFoundError:
            return None
        except OSError:
            return b""  # unreadable: treated as expired

    def _read(self) -> dict | None:
        return _holder(self._read_raw())

    def _claim(self, record: bytes) -> bool:
        """Whether this run is the one that takes over this expired record."""
        marker = self.path.with_name(f"{self.path.name}.takeover-{hashlib.sha256(record).hexdigest()[:16]}")
        try:
            self.path.fs.pipe_file(marker.path, self.token.encode(), mode="create")
        except FileExistsError:
            return False
        return True

    def __enter__(self) -> LeaseLock:
        if not self._create():
            record = self._read_raw()
            holder = _holder(record)
            if holder and not lease_expired(holder):
                raise LockHeld(self.path, holder)
            if record is not None and not self._claim(record):  # another run takes this expired lease over
                raise LockHeld(self.path, self._read() or holder)
            self.stale = holder
            if record is not None:
                self.path.fs.rm_file(self.path.path)
            if not self._create():  # another run took the lease first
                raise LockHeld(self.path, self._read())
        self._thread = threading.Thread(target=self._renew, name="lease-renewal", daemon=True)
        self._thread.start()
        return self

    def _renew(self) -> None:
        while not self._stop.wait(self.ttl / 4):
            holder = self._read()
            if not holder or holder.get("token") != self.token:
                self.lost = True
                return
            self.path.fs.pipe_file(self.path.path, self._record())

    def check(self) -> None:
        """Before a commit: refuse to write once the lease is gone."""
        if self.lost:
            raise LeaseLost(f"{self.path.parent}: another run took over this run's lease; stopping without committing")

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        holder = self._read()
        if holder and holder.get("token") == self.token:
            self.path.fs.rm_file(self.path.path)
