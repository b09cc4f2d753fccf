"""Fixtures of the server tests: a scripted engine and the real app serving it on loopback;
for the slow tests, the demo pair behind a real `python -m engine serve` (one per module)."""

from __future__ import annotations

import openai
import pytest

from tests.helpers.engine_server import serve_demo_pair
from tests.helpers.scripted_server import WAIT_S, ScriptedEngine, running


@pytest.fixture
def engine() -> ScriptedEngine:
    return ScriptedEngine()


@pytest.fixture
def server(engine):
    with running(engine) as (url, state):
        assert state.worker.ready.wait(WAIT_S)
        yield url, state


@pytest.fixture(scope="module")
def server_process(tmp_path_factory):
    yield from serve_demo_pair(tmp_path_factory.mktemp("serve") / "serve.log")


@pytest.fixture(scope="module")
def client(server_process) -> openai.OpenAI:
    return openai.OpenAI(base_url=server_process.url + "/v1", api_key="none", max_retries=0)
