import pytest

from tests.helpers import Messages


@pytest.fixture
def progress() -> Messages:
    return Messages()
