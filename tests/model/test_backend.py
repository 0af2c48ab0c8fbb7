"""Both ops modules keep the model's ops contract (backend.OpsBackend) with the same signatures."""

import pytest

from batchjob.model import cpu_ops, ops
from batchjob.model.backend import OpsBackend
from tests.helpers import protocol_gaps


def test_the_torch_ops_keep_the_backend_contract():
    assert protocol_gaps(ops, OpsBackend) == []
    assert protocol_gaps(cpu_ops, OpsBackend) == []


def test_the_triton_kernels_keep_the_backend_contract():
    pytest.importorskip("triton", reason="the Triton kernels need triton (the test extra)")
    from batchjob.kernels import ops as kernels_ops  # conftest set TRITON_INTERPRET=1 on a CPU

    assert protocol_gaps(kernels_ops, OpsBackend) == []


def test_only_the_triton_kernels_can_be_captured_in_a_cuda_graph():
    pytest.importorskip("triton", reason="the Triton kernels need triton (the test extra)")
    from batchjob.kernels import ops as kernels_ops

    assert kernels_ops.CAPTURABLE and not ops.CAPTURABLE and not cpu_ops.CAPTURABLE
