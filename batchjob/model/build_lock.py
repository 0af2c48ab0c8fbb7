"""One build at a time of a cached artifact (the C++ CPU kernels, llama.cpp's binaries): an exclusive flock of ours,
which dies with its holder, so that a killed build never wedges later runs (a lock file's mere existence would)."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import time
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)

_POLL_S = 0.2  # short sleeps while waiting for another build: a signal's handler runs between them


@contextlib.contextmanager
def build_lock(path: Path, wait: float, what: str, setting: str | None = None) -> Iterator[None]:
    """An exclusive flock on `path`, released when the body ends or this process dies, however it dies; waits `wait`
    seconds at most for another holder, then raises TimeoutError. `what` names the build in the messages and
    `setting` the variable that sets `wait`, if one does."""
    with open(path, "a") as f:  # closing it releases the lock
        deadline, said = time.monotonic() + wait, False
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"another process held the build lock {path} for the {wait:g} s this one waits"
                        + (f" ({setting})" if setting else "")
                    ) from None
                if not said:  # a wait that says nothing looks like a hang
                    log.warning("waiting up to %g s for another process's build of %s: %s", wait, what, path)
                    said = True
                time.sleep(_POLL_S)
        yield
