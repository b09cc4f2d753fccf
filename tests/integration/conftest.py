"""Fixtures of the integration tests: the hub every simulated site stages its models from."""

from __future__ import annotations

import pytest

from tests.helpers.site import make_tiny_hub_root


@pytest.fixture(scope="module")
def hub_root(tmp_path_factory: pytest.TempPathFactory):
    """A local hub's root holding the tiny model pair (tests/helpers/site.py), one per module."""
    return make_tiny_hub_root(tmp_path_factory.mktemp("hub"))
