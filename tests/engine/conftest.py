"""Fixtures of the engine tests."""

from __future__ import annotations

import pytest

from tests.helpers.tiny_hybrid import torch_threads


@pytest.fixture(scope="module")
def one_torch_thread():
    """Torch on one thread for a module of tiny models: tiny ops run several times faster on one
    thread than on two when the machine is busy."""
    with torch_threads(1):
        yield
