"""Fixtures of the server tests: a scripted engine and the real app serving it on loopback."""

from __future__ import annotations

import pytest

from tests.helpers.scripted_server import WAIT_S, ScriptedEngine, running


@pytest.fixture
def engine() -> ScriptedEngine:
    return ScriptedEngine()


@pytest.fixture
def server(engine):
    with running(engine) as (url, state):
        assert state.worker.ready.wait(WAIT_S)
        yield url, state
