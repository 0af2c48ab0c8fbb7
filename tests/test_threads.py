"""OpenMP's wait policy, set by `import batchjob` before torch is imported (batchjob/__init__.py)."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.helpers import REPO

SHOW = "import os, batchjob; print(os.environ['OMP_WAIT_POLICY'], os.environ['GOMP_SPINCOUNT'])"


def _policy(**env: str) -> str:
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    run = subprocess.run([sys.executable, "-c", SHOW], env=base | env, cwd=REPO, capture_output=True, text=True)
    return run.stdout.strip()


def test_threads_sleep_after_a_short_spin_unless_the_user_says_otherwise():
    assert _policy() == "PASSIVE 3000"
    assert _policy(GOMP_SPINCOUNT="0", OMP_WAIT_POLICY="ACTIVE") == "ACTIVE 0"
