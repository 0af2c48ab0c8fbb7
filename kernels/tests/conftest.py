"""Triton's interpreter must be on before any kernel is defined (triton.jit decides at import time): switch it on
here, before the test modules import kernels.*, unless a CUDA device can run the kernels for real."""
import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"
