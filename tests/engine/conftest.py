"""Fixtures of the engine tests."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.tiny_hybrid import torch_threads
from tests.helpers.tiny_pairs import KINDS, load_tiny_pair


@pytest.fixture(scope="module")
def one_torch_thread():
    """Torch on one thread for a module of tiny models: tiny ops run several times faster on one
    thread than on two when the machine is busy."""
    with torch_threads(1):
        yield


@pytest.fixture
def fresh_dynamo():
    """torch.compile's caches emptied before and after a test that counts recompiles."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="module", params=KINDS)
def float64_pair(request, tmp_path_factory):
    """A tiny (target, drafter) pair of each kind in float64: where a batched pass's outputs
    must equal the sequences' solo runs token for token."""
    return load_tiny_pair(
        tmp_path_factory.mktemp(request.param), request.param, dtype=torch.float64
    )
