"""Fixtures of the integration tests: the hub every simulated site stages its models from."""

from __future__ import annotations

import pytest

# torch's compiler must load before any test imports ansible: ansible's import patches
# sys.intern with an object that torch._dynamo's import (reached through transformers when the
# tiny hub is made) then rejects. Run in the whole suite, something else loaded it earlier.
import torch._dynamo  # noqa: F401  # isort: skip

from tests.helpers.site import make_tiny_hub_root


@pytest.fixture(scope="module")
def hub_root(tmp_path_factory: pytest.TempPathFactory):
    """A local hub's root holding the tiny model pair (tests/helpers/site.py), one per module."""
    return make_tiny_hub_root(tmp_path_factory.mktemp("hub"))
