from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="the oracle needs the test extra")


@pytest.fixture(scope="module")
def idefics3(tmp_path_factory):
    """(folder, transformers' model) of a tiny random-weight Idefics3 with its processor."""
    from tests.vision.tiny_idefics3 import build

    folder = tmp_path_factory.mktemp("idefics3")
    return folder, build(folder)
