"""OpenMP's settings: `import batchjob` changes no environment variable; the CLI and the first use of `Engine` set
the defaults before torch loads (batchjob/env.py), and the user's values win."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.helpers import REPO

SHOW = "import os; print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'), end=' ')"
IMPORT_ONLY = f"import batchjob; {SHOW}"
ENGINE = f"import sys, batchjob; batchjob.Engine; {SHOW}; print('torch' in sys.modules)"
CLI = f"from batchjob.cli import main\ntry: main(['status', '/no/such/folder'])\nexcept SystemExit: pass\n{SHOW}"
SCOPED = (
    "import os, batchjob.env as e; e.configure_threads()\n"
    "with e.scoped({**e.set_here(), 'VLLM_CPU_NUM_OF_RESERVED_CPU': '0'}):\n"
    "    print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('VLLM_CPU_NUM_OF_RESERVED_CPU'), end=' ')\n"
    f"print(os.environ.get('VLLM_CPU_NUM_OF_RESERVED_CPU'), end=' '); {SHOW}"
)


def _run(code: str, **env: str) -> str:
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    run = subprocess.run([sys.executable, "-c", code], env=base | env, cwd=REPO, capture_output=True, text=True)
    return run.stdout.strip()


def test_importing_batchjob_changes_no_environment_variable():
    assert _run(IMPORT_ONLY) == "None None"


def test_the_engine_and_the_cli_set_a_short_spin_before_torch_loads_unless_the_user_says_otherwise():
    assert _run(ENGINE) == "PASSIVE 3000 True"
    assert _run(ENGINE, GOMP_SPINCOUNT="0", OMP_WAIT_POLICY="ACTIVE") == "ACTIVE 0 True"
    assert _run(CLI) == "PASSIVE 3000"


def test_a_peer_started_in_scope_gets_its_own_defaults_and_ours_come_back():
    assert _run(SCOPED) == "None 0 None PASSIVE 3000"
    assert _run(SCOPED, OMP_WAIT_POLICY="ACTIVE") == "ACTIVE 0 None ACTIVE 3000"  # the user's value is not ours
