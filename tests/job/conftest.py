import pytest

import batchjob.job.output.digest
from tests.helpers import Messages


@pytest.fixture
def progress() -> Messages:
    return Messages()


@pytest.fixture(autouse=True)
def digest_memo(tmp_path_factory, monkeypatch):
    """Input digests are remembered in a folder of the test session, not in the user's cache."""
    folder = tmp_path_factory.getbasetemp() / "cache"
    monkeypatch.setattr(batchjob.job.output.digest, "cache_dir", lambda: folder)
