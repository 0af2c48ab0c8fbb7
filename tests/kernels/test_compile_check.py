"""Ahead-of-time compile of the kernels for sm_90 (PTX + ptxas) without a GPU. Marked slow (~20 s): it runs in a
subprocess, because this test process runs the kernels in the interpreter. Run with `pytest kernels -m slow`."""

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU compiles the kernels for real in the other tests")
def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run(
        [sys.executable, "-m", "batchjob.bench.compile_check", "--quick"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
