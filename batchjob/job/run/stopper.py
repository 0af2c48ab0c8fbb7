"""SIGINT/SIGTERM/SIGHUP during a run: stop admitting work, give requests in flight a grace, then drop them."""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Iterator

from batchjob.job.exit_codes import EXIT_SIGNAL


class Interrupted(BaseException):
    """A signal came during Stopper.interruptible(). A BaseException, as KeyboardInterrupt is: code that falls back
    on any Exception (a failed kernel build, a chat template that raises) must not swallow a stop."""


class Stopper:
    """SIGINT/SIGTERM/SIGHUP: stop admitting work; requests in flight get `grace` seconds to finish, and the end of
    the grace or a second signal drops the rest (uncommitted, so they run again on resume)."""

    def __init__(self, grace: float):
        self.grace = grace
        self.signum: int | None = None
        self.count = 0
        self.since = 0.0
        self.interrupt_at = 0  # within interruptible(): the signal count that raises Interrupted; 0 outside

    def __enter__(self) -> Stopper:
        # Python takes signals in the main thread only: a run in another thread (the Python API's caller's) keeps
        # the process's handlers and stops only with the process.
        main = threading.current_thread() is threading.main_thread()
        self._previous = {s: signal.signal(s, self._handle) for s in EXIT_SIGNAL} if main else {}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def _handle(self, signum: int, frame) -> None:
        if self.signum is None:
            self.signum, self.since = signum, time.monotonic()
        self.count += 1
        if self.interrupt_at and self.count >= self.interrupt_at:
            raise Interrupted(signum)

    @property
    def stopping(self) -> bool:
        return self.signum is not None

    @contextlib.contextmanager
    def interruptible(self, signals: int = 1) -> Iterator[None]:
        """Within it the `signals`-th signal also raises Interrupted, to leave a blocking wait that cannot look at
        the flag (a model load waits for one more signal: the first lets it finish, a second ends it at once)."""
        if self.count >= signals:
            raise Interrupted(self.signum)
        self.interrupt_at = signals
        try:
            yield
        finally:
            self.interrupt_at = 0

    @property
    def drop_in_flight(self) -> bool:
        return self.count > 1 or (self.signum is not None and time.monotonic() - self.since >= self.grace)
