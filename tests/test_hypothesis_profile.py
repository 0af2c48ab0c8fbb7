"""The property tests' profiles (tests/conftest.py): CI draws the same examples on every run, a local run new ones."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.helpers import REPO

DRAW = """
import json
from hypothesis import given, strategies as st
import tests.conftest  # noqa: F401  (registers and loads the profile)

seen = []

@given(st.integers(0, 2**60))
def draw(x):
    seen.append(x)

draw()
print(json.dumps(seen))
"""


def draws(**env: str) -> list[int]:
    clean = {k: v for k, v in os.environ.items() if k not in ("CI", "HYPOTHESIS_PROFILE")}
    out = subprocess.run(
        [sys.executable, "-c", DRAW], cwd=REPO, env=clean | env, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.splitlines()[-1])


def test_ci_draws_the_same_examples_and_a_local_run_new_ones():
    assert draws(CI="true") == draws(CI="true")
    assert draws() != draws()
