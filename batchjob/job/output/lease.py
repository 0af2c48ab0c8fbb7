"""One run per output folder on S3: a lease object that a live run renews, every write of it conditional.

Object stores have no flock, and no process there notices that a holder died, so the lock is `_lock` holding {pid,
host, started, token, expires}. Every change to it is a compare-and-swap on S3's conditional requests: a run takes it
by a conditional create (`If-None-Match: *`): of two runs starting at once exactly one succeeds. A thread rewrites it
every quarter of `lease_seconds` with a later expiry, each rewrite only if the object is still the version this run
last wrote (`If-Match: <ETag>`), so a renewal can never overwrite a lease another run has taken. A run killed with -9
stops renewing; once its lease has expired the next run takes it over: first it claims that expired record by creating
a marker named after the record's digest (`_lock.takeover-<digest>`, the same conditional create), then deletes that
version of the lease (`If-Match` again: a holder that renewed meanwhile keeps it) and creates its own. The markers
stay (a few bytes per takeover). A run that finds its lease taken, or that has not renewed it for longer than the
lease lasts (a stall, an unreachable store), stops committing (LeaseLost); its parts carry its own tag, so it cannot
overwrite the parts of the run that took over. Expiry is judged by the clocks of the runs, so they must agree to well
within `lease_seconds`. Other object stores have no such requests through their fsspec drivers and are refused."""

from __future__ import annotations

import errno
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
    """This run no longer holds its lease: it must not commit anything more (exit code 75, as for a held lock)."""


class LeaseUnsupported(Exception):
    """The output's store has no conditional writes to build a lease on."""


def _holder(record: bytes | None) -> dict | None:
    if record is None:
        return None
    try:
        holder = json.loads(record)
    except ValueError:
        return {}  # unreadable: treated as expired
    return holder if isinstance(holder, dict) else {}


now = time.time  # the clock leases are judged by; a test moves it instead of racing a loaded host


def lease_expired(holder: dict) -> bool:
    return float(holder.get("expires", 0)) <= now()


def _precondition_failed(error: OSError) -> bool:
    return error.errno == errno.EINVAL  # s3fs's translation of S3's 412 Precondition Failed


class S3Object:
    """One S3 object changed only by conditional requests; each version is named by its ETag."""

    def __init__(self, path: UPath):
        if "s3" not in path.fs.protocol:
            raise LeaseUnsupported(
                f"{path.parent}: an output folder on {path.protocol}:// is not supported; batchjob's lease needs S3's "
                "conditional writes (use s3://, or a local folder)"
            )
        self.fs, self.path = path.fs, path.path
        self.bucket, self.key, _ = self.fs.split_path(self.path)

    def create(self, data: bytes) -> str | None:
        """The new object's ETag; None if the object exists."""
        try:
            return self.fs.call_s3("put_object", Bucket=self.bucket, Key=self.key, Body=data, IfNoneMatch="*")["ETag"]
        except FileExistsError:
            return None

    def read(self) -> tuple[bytes, str] | None:
        """The object and its ETag, of one version (s3fs reads with If-Match on the ETag it saw); None if absent."""
        self.fs.invalidate_cache(self.path)  # the ETag from a fresh HEAD, not from an earlier listing
        try:
            with self.fs.open(self.path, "rb", cache_type="none") as f:
                return f.read(), f.details["ETag"]
        except FileNotFoundError:
            return None

    def replace(self, data: bytes, etag: str) -> str | None:
        """The new version's ETag; None if the object is no longer version `etag`."""
        try:
            return self.fs.call_s3("put_object", Bucket=self.bucket, Key=self.key, Body=data, IfMatch=etag)["ETag"]
        except FileNotFoundError:
            return None
        except OSError as e:
            if _precondition_failed(e):
                return None
            raise

    def delete(self, etag: str) -> bool:
        """Whether version `etag` was there and is deleted."""
        try:
            self.fs.call_s3("delete_object", Bucket=self.bucket, Key=self.key, IfMatch=etag)
        except FileNotFoundError:
            return False
        except OSError as e:
            if _precondition_failed(e):
                return False
            raise
        finally:
            self.fs.invalidate_cache(self.path)
        return True


class LeaseLock:
    def __init__(self, path: UPath, lease_seconds: float):
        self.path, self.ttl = path, lease_seconds
        self.object = S3Object(path)
        self.token = secrets.token_hex(4)
        self.stale: dict | None = None  # an expired lease, taken over on acquire
        self.lost = False
        self.etag = ""  # the version of the lease this run last wrote
        self.valid_until = 0.0  # the expiry it holds
        self._guard = threading.Lock()  # the renewal thread and a commit's check renew one at a time
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.holder = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "token": self.token,
        }

    def _record(self, expires: float) -> bytes:
        return json.dumps({**self.holder, "expires": expires}).encode()

    def _create(self) -> bool:
        expires = now() + self.ttl
        etag = self.object.create(self._record(expires))
        if etag is None:
            return False
        self.etag, self.valid_until = etag, expires
        return True

    def _read_raw(self) -> tuple[bytes, str] | None:
        try:
            return self.object.read()
        except OSError:
            return b"", ""  # unreadable: treated as expired, and no version of it can be deleted

    def _read(self) -> dict | None:
        found = self._read_raw()
        return _holder(found[0] if found else None)

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
            found = self._read_raw()
            holder = _holder(found[0] if found else None)
            if holder and not lease_expired(holder):
                raise LockHeld(self.path, holder)
            if found is not None:
                record, etag = found
                # Unreadable (no version to delete), claimed by another run, or renewed or taken since it was read:
                # another run has it, or may; exit 75 says try again later.
                if not etag or not self._claim(record) or not self.object.delete(etag):
                    raise LockHeld(self.path, self._read() or holder)
            self.stale = holder
            if not self._create():  # another run took the lease first
                raise LockHeld(self.path, self._read())
        self._thread = threading.Thread(target=self._renew, name="lease-renewal", daemon=True)
        self._thread.start()
        return self

    def _renew_once(self) -> None:
        with self._guard:
            if self.lost:
                return
            expires = now() + self.ttl
            try:
                etag = self.object.replace(self._record(expires), self.etag)
            except OSError:
                return  # the store did not answer: check() refuses to commit once the held expiry is near
            if etag is None:
                self.lost = True
            else:
                self.etag, self.valid_until = etag, expires

    def _renew(self) -> None:
        while not self._stop.wait(self.ttl / 4) and not self.lost:
            self._renew_once()

    def check(self) -> None:
        """Before a commit: refuse to write once the lease is gone, or when less than half of it is left (a stalled
        or cut-off run: renew now, and refuse if that fails), so that a commit ends well before the lease could."""
        if not self.lost and self.valid_until - now() < self.ttl / 2:
            self._renew_once()
        if self.lost:
            raise LeaseLost(f"{self.path.parent}: another run took over this run's lease; stopping without committing")
        if self.valid_until - now() < self.ttl / 2:
            raise LeaseLost(
                f"{self.path.parent}: this run could not renew its lease for {self.ttl / 2:g} s (is the store "
                "reachable?); stopping without committing"
            )

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if not self.lost:
            self.object.delete(self.etag)  # only the version this run wrote: never another run's lease
