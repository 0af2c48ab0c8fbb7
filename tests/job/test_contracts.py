"""The job layer's contracts: the engine (contracts.JobEngine), kept by the real engine and the tests' fake, and the
executor (executor.Executor), kept by the local and the Ray executor."""

import pytest

from batchjob.job.contracts import JobEngine, Tokenizer
from batchjob.job.run.executor import Executor, LocalExecutor
from batchjob.job.spec import RaySpec
from tests.fakes import FakeEngine
from tests.helpers import fake_factory, protocol_gaps


def test_the_fake_engine_keeps_the_job_layers_contract():
    fake = FakeEngine()
    assert protocol_gaps(fake, JobEngine) == []
    assert protocol_gaps(fake.tokenizer, Tokenizer) == []


def test_the_real_engine_keeps_the_job_layers_contract(engine):
    assert protocol_gaps(engine, JobEngine) == []
    assert protocol_gaps(engine.tokenizer, Tokenizer) == []


def test_a_missing_member_or_a_different_signature_is_a_gap():
    class Partial(FakeEngine):
        def stream(self, reqs):  # renamed parameter
            return super().stream(reqs)

    gaps = protocol_gaps(Partial(), JobEngine)
    assert gaps == ["stream: parameters ['reqs'], the protocol's ['requests']"]
    assert "abort_all: missing" in protocol_gaps(object(), JobEngine)


def test_both_executors_keep_the_executor_contract(tmp_path):
    assert protocol_gaps(LocalExecutor(fake_factory(), tmp_path / "_timeline.parquet"), Executor) == []
    pytest.importorskip("ray.data", reason="Ray is an optional extra: pip install -e '.[ray]'")
    from batchjob.job.run.ray_executor import RayExecutor

    assert protocol_gaps(RayExecutor(RaySpec(), fake_factory()), Executor) == []
