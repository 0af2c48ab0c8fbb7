"""The job layer's engine contract (contracts.JobEngine): the real engine and the tests' fake both keep it."""

from batchjob.job.contracts import JobEngine, Tokenizer
from tests.fakes import FakeEngine
from tests.helpers import protocol_gaps


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
