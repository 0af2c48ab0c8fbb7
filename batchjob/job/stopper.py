"""SIGINT/SIGTERM during a run: stop admitting work, give requests in flight a grace, then drop them."""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Iterator

from batchjob.job.exit_codes import EXIT_SIGNAL


class Interrupted(Exception):
    """A signal came during Stopper.interruptible()."""


class Stopper:
    """SIGINT/SIGTERM: stop admitting work; requests in flight get `grace` seconds to finish, and the end of the grace
    or a second signal drops the rest (uncommitted, so they run again on resume)."""

    def __init__(self, grace: float):
        self.grace = grace
        self.signum: int | None = None
        self.count = 0
        self.since = 0.0
        self.interrupt = False

    def __enter__(self) -> Stopper:
        self._previous = {s: signal.signal(s, self._handle) for s in EXIT_SIGNAL}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def _handle(self, signum: int, frame) -> None:
        if self.signum is None:
            self.signum, self.since = signum, time.monotonic()
        self.count += 1
        if self.interrupt:
            raise Interrupted(signum)

    @property
    def stopping(self) -> bool:
        return self.signum is not None

    @contextlib.contextmanager
    def interruptible(self) -> Iterator[None]:
        """Within it a signal also raises Interrupted, to leave a blocking wait that cannot look at the flag."""
        if self.signum is not None:
            raise Interrupted(self.signum)
        self.interrupt = True
        try:
            yield
        finally:
            self.interrupt = False

    @property
    def drop_in_flight(self) -> bool:
        return self.count > 1 or (self.signum is not None and time.monotonic() - self.since >= self.grace)
