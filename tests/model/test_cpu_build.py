"""The C++ kernels' build (model/cpu_native.py) on a hostile host: a build killed midway, another process holding the
build lock, cron's PATH, a signal during the wait or the build. The builds run in child processes over a fresh
BATCHJOB_CACHE (a process can load the ops library only once), each bounded by a timeout, so a hang fails the test."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from batchjob.model import cpu_native
from tests.helpers import REPO

# Gets the ops and says which ran: the C++ ones, checked against the torch op, or the torch fallback.
USE_OPS = """
import torch
from batchjob.model import cpu_native, ops
native = cpu_native.native_ops()
x = torch.randn(5, 64)
print("native ops work" if native is not None and torch.allclose(native.silu_and_mul(x), ops.silu_and_mul(x))
      else "torch ops", flush=True)
"""
# As a job's model load runs it: under the runner's Stopper, within interruptible() (the executor's second signal).
STOPPABLE = """
import sys
from batchjob.job.run.stopper import Interrupted, Stopper
from batchjob.model import cpu_native
with Stopper(grace=0) as stopper:
    try:
        with stopper.interruptible(signals=1):
            cpu_native.native_ops()
    except Interrupted:
        print("interrupted", flush=True)
        sys.exit(0)
print("not interrupted", flush=True)
"""
# Holds the build lock as a builder in another process does, until killed.
HOLD = """
import fcntl, sys, time
f = open(sys.argv[1], "a")
fcntl.flock(f, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(600)
"""
BUILD_WAIT = "450"  # long enough for a build on a busy two-core machine, short of the tests' timeouts


class Child:
    """A `python -c` in its own session (so its compilers can be killed with it), output in files under `folder`."""

    def __init__(self, folder: Path, code: str, args: tuple[str, ...], env: dict[str, str]):
        folder.mkdir(parents=True)
        self.out, self.err = folder / "stdout", folder / "stderr"
        with self.out.open("w") as out, self.err.open("w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", code, *args],
                cwd=REPO,
                env={**os.environ, **env},
                stdout=out,
                stderr=err,
                start_new_session=True,
            )

    def wait_for(self, text: str, timeout: float, stream: str = "err") -> None:
        """Until `text` shows in its stderr (or stdout); fails if it ends or the time runs out first."""
        path = self.err if stream == "err" else self.out
        deadline = time.monotonic() + timeout
        while text not in path.read_text():
            assert self.proc.poll() is None, f"ended before saying {text!r}: {self.err.read_text()}"
            assert time.monotonic() < deadline, f"did not say {text!r} within {timeout} s: {self.err.read_text()}"
            time.sleep(0.05)

    def finish(self, timeout: float) -> tuple[str, str]:
        """stdout and stderr once it exits; a child still running after `timeout` s fails the test as hung."""
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running after {timeout} s (hung): {self.err.read_text()}")
        finally:
            self.kill()
        return self.out.read_text().strip(), self.err.read_text()

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # the session: ninja's compilers too
        self.proc.wait()


class Spawner:
    """Children over one fresh BATCHJOB_CACHE (`cache`; set here too, for build_paths), all killed at the end."""

    def __init__(self, tmp_path: Path):
        self.tmp_path, self.cache = tmp_path, tmp_path / "cache"
        self.children: list[Child] = []

    def __call__(self, name: str, code: str, *args: str, **env: str) -> Child:
        child = Child(self.tmp_path / name, code, args, {"BATCHJOB_CACHE": str(self.cache), **env})
        self.children.append(child)
        return child

    def hold_lock(self) -> Child:
        """Another process holding the build lock, as a builder does."""
        _, lock = cpu_native.build_paths()
        lock.parent.mkdir(parents=True, exist_ok=True)
        holder = self("holder", HOLD, str(lock))
        holder.wait_for("held", timeout=30, stream="out")
        return holder


@pytest.fixture
def spawn(tmp_path, monkeypatch) -> Iterator[Spawner]:
    spawner = Spawner(tmp_path)
    monkeypatch.setenv("BATCHJOB_CACHE", str(spawner.cache))
    yield spawner
    for child in spawner.children:
        child.kill()


@pytest.mark.slow
def test_a_build_killed_midway_does_not_stop_the_next_runs(spawn):
    """kill -9 a process mid-build (the OOM killer, a CI timeout): two later runs at once get the C++ ops, one
    building them while the other waits for it, instead of waiting forever on a lock the dead process left."""
    first = spawn("first", USE_OPS)
    deadline = time.monotonic() + 120
    while not (spawn.cache.exists() and any(spawn.cache.rglob("build.ninja"))):  # written before ninja starts
        assert first.proc.poll() is None, first.err.read_text()
        assert time.monotonic() < deadline, f"no build started within 120 s: {first.err.read_text()}"
        time.sleep(0.05)
    time.sleep(1)  # the compilers are running
    first.kill()
    folder, _ = cpu_native.build_paths()
    assert not folder.exists()  # a half-built folder never has the name that later runs load from
    nexts = [spawn(f"next{i}", USE_OPS, BATCHJOB_CPU_OPS_BUILD_WAIT=BUILD_WAIT) for i in (1, 2)]
    results = [n.finish(timeout=480) for n in nexts]
    for out, err in results:
        assert out == "native ops work", err
        assert "unavailable" not in err
    assert sum(err.count("building the C++ CPU kernels") for _, err in results) == 1
    assert sorted(p.name for p in folder.parent.iterdir()) == [folder.name, f"{folder.name}.lock"]  # killed one's too


@pytest.mark.slow
def test_the_build_finds_the_venvs_ninja_under_crons_path_and_later_runs_do_not_rebuild(spawn, tmp_path):
    """cron's PATH (no venv bin) with another ninja first on it, one that fails and records that it ran (where no
    ninja is on PATH at all, the build failed the same way). The build must use the venv's ninja; a later run loads
    the library without a lock or a build: it gets the ops with the lock held elsewhere and cpp_extension.load
    broken."""
    foreign = tmp_path / "bin" / "ninja"
    foreign.parent.mkdir()
    foreign.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "foreign-ninja-ran"}\nexit 1\n')
    foreign.chmod(0o755)
    compiler = os.path.dirname(shutil.which("c++"))
    path = os.pathsep.join([str(foreign.parent), compiler, "/usr/bin", "/bin"])
    out, err = spawn("cron", USE_OPS, PATH=path).finish(timeout=480)
    assert out == "native ops work", err
    assert "unavailable" not in err and err.count("building the C++ CPU kernels") == 1
    assert not (tmp_path / "foreign-ninja-ran").exists()

    spawn.hold_lock()
    no_build = "import torch.utils.cpp_extension as c\ndef load(*a, **k): raise AssertionError('built again')\n"
    out, err = spawn("later", no_build + USE_OPS, PATH=path, BATCHJOB_CPU_OPS_BUILD_WAIT="0").finish(timeout=60)
    assert out == "native ops work", err  # a build or a lock taken would have meant the torch ops
    assert "building" not in err and "waiting" not in err


def test_a_build_lock_held_past_the_wait_gives_the_torch_ops_with_one_warning(spawn):
    """Another process building (or stuck while building) for longer than BATCHJOB_CPU_OPS_BUILD_WAIT: this one
    runs the torch ops after that wait, says so once, and does not wait again."""
    spawn.hold_lock()
    again = "cpu_native.native_ops()\nprint(time.monotonic() - start)\n"
    timed = "import time\nstart = time.monotonic()\n" + USE_OPS + again
    out, err = spawn("waiter", timed, BATCHJOB_CPU_OPS_BUILD_WAIT="1.5").finish(timeout=60)
    ops, elapsed = out.splitlines()
    assert ops == "torch ops", err
    assert 1.5 <= float(elapsed) < 10
    assert err.count("C++ CPU ops unavailable, using the torch ops") == 1, err
    assert "BATCHJOB_CPU_OPS_BUILD_WAIT" in err and err.count("waiting up to 1.5 s") == 1, err


def test_a_wait_that_is_not_a_number_is_the_default_with_a_warning(monkeypatch, caplog):
    monkeypatch.setenv("BATCHJOB_CPU_OPS_BUILD_WAIT", "5m")
    with caplog.at_level(logging.WARNING):
        assert cpu_native._build_wait() == 300
    assert "BATCHJOB_CPU_OPS_BUILD_WAIT='5m' is not a number of seconds" in caplog.text


def test_a_signal_ends_the_wait_for_another_build(spawn):
    """A job's model load waiting for another process's build stops at the signal that interrupts it, at once."""
    spawn.hold_lock()
    waiter = spawn("waiter", STOPPABLE, BATCHJOB_CPU_OPS_BUILD_WAIT="600")
    waiter.wait_for("waiting up to 600 s", timeout=60)
    os.kill(waiter.proc.pid, signal.SIGTERM)
    out, err = waiter.finish(timeout=20)
    assert out == "interrupted", err


def test_a_signal_during_the_build_stops_it_and_leaves_no_build(spawn):
    """The signal is not taken for a failed build (which would fall back to the torch ops and load on), and the
    half-built folder is never taken for a build."""
    builder = spawn("builder", STOPPABLE)
    builder.wait_for("building the C++ CPU kernels", timeout=120)
    time.sleep(1)
    os.kill(builder.proc.pid, signal.SIGTERM)
    out, err = builder.finish(timeout=20)
    assert out == "interrupted", err
    assert "unavailable" not in err
    folder, _ = cpu_native.build_paths()
    assert not folder.exists()
