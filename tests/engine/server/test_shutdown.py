"""The engine server stopping with requests in flight: each is answered 503 "server shutting
down" (a stream: an error event, then [DONE]), none a 500 or a traceback; those that finish within
the grace period are served. A scripted engine in-process here; the real `python -m engine serve`
process under SIGTERM in tests/engine/server/test_e2e.py.
"""

from __future__ import annotations

import json
import logging
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.helpers.scripted_server import WAIT_S, ScriptedEngine, complete, running, wait_until


def stream_events(url: str) -> list:
    """The data of each server-sent event of a streamed completion."""
    body = {"prompt": "hi", "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=WAIT_S) as response:
        assert response.status_code == 200
        lines = [line.removeprefix("data: ") for line in response.iter_lines() if line]
    return [line if line == "[DONE]" else json.loads(line) for line in lines]


def assert_cut(response: httpx.Response) -> None:
    assert response.status_code == 503, response.text
    assert response.json()["error"]["message"] == "server shutting down"
    assert response.json()["error"]["code"] == "shutting_down"
    assert response.headers["retry-after"] == "1"


def assert_no_errors_logged(caplog) -> None:
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert not errors, [r.getMessage() for r in errors]


@pytest.fixture
def engine() -> ScriptedEngine:
    return ScriptedEngine()


def hold(engine: ScriptedEngine, state) -> None:
    """Once the warm-up is done, generations wait in their first round (until gate.set())."""
    assert state.worker.ready.wait(WAIT_S)
    engine.started.clear()
    engine.gate.clear()


def test_running_and_waiting_requests_are_answered_503_at_shutdown(engine, caplog):
    with ThreadPoolExecutor(3) as pool:
        with running(engine, shutdown_grace_s=0) as (url, state):
            hold(engine, state)
            streamed = pool.submit(stream_events, url)
            assert engine.started.wait(WAIT_S)
            waiting = pool.submit(complete, url)
            wait_until(lambda: state.worker.waiting == 1)
        # Leaving `running` stopped the server, with both requests in flight.
        assert_cut(waiting.result())
        *_, error, done = streamed.result()
    assert error["error"]["message"] == "server shutting down"
    assert error["error"]["code"] == "shutting_down"
    assert done == "[DONE]"
    assert engine.cancelled.is_set()  # the running generation was stopped, not left to run
    assert_no_errors_logged(caplog)


def test_a_non_streamed_request_cut_at_shutdown_is_a_503(engine, caplog):
    with ThreadPoolExecutor(1) as pool:
        with running(engine, shutdown_grace_s=0) as (url, state):
            hold(engine, state)
            cut = pool.submit(complete, url)
            assert engine.started.wait(WAIT_S)
        assert_cut(cut.result())
    assert_no_errors_logged(caplog)


def test_a_request_that_finishes_within_the_grace_period_is_served(engine, caplog):
    with ThreadPoolExecutor(1) as pool:
        with running(engine, shutdown_grace_s=WAIT_S) as (url, state):
            hold(engine, state)
            begin_shutdown = state.begin_shutdown

            def shutdown_then_finish() -> None:
                begin_shutdown()
                engine.gate.set()  # the generation goes on only once shutdown has begun

            state.begin_shutdown = shutdown_then_finish
            served = pool.submit(complete, url)
            assert engine.started.wait(WAIT_S)
        response = served.result()
    assert response.status_code == 200
    assert response.json()["choices"][0]["text"] == "Hello world!"
    assert_no_errors_logged(caplog)
