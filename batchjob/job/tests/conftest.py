import pytest

from batchjob.job.tests.helpers import Messages


@pytest.fixture
def progress() -> Messages:
    return Messages()
