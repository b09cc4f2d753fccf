"""Fixtures of the server tests: a scripted engine and the real app serving it on loopback
(plain, or behind the demo pair's chat template for agents); for the slow tests, the demo pair
behind a real `python -m engine serve` (one per module)."""

from __future__ import annotations

import openai
import pytest

from tests.helpers.conversations import THINK_THEN_CALL
from tests.helpers.engine_server import serve_demo_pair
from tests.helpers.scripted_server import (
    WAIT_S,
    AgentTokenizer,
    RecordingEngine,
    ScriptedEngine,
    loaded,
    running,
)


@pytest.fixture
def engine() -> ScriptedEngine:
    return ScriptedEngine()


@pytest.fixture
def server(engine):
    with running(engine) as (url, state):
        assert state.worker.ready.wait(WAIT_S)
        yield url, state


@pytest.fixture(scope="module")
def agent_server():
    """A recording engine behind the demo pair's chat template (Qwen3's structure, hermes tool
    calls): (engine, base url)."""
    engine = RecordingEngine(THINK_THEN_CALL)
    load = lambda: loaded(engine, max_model_len=8192, tokenizer=AgentTokenizer())  # noqa: E731
    with running(engine, load=load) as (url, state):
        assert state.worker.ready.wait(WAIT_S)
        yield engine, url


@pytest.fixture(scope="module")
def server_process(tmp_path_factory):
    yield from serve_demo_pair(tmp_path_factory.mktemp("serve") / "serve.log")


@pytest.fixture(scope="module")
def client(server_process) -> openai.OpenAI:
    return openai.OpenAI(base_url=server_process.url + "/v1", api_key="none", max_retries=0)
