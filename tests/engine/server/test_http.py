"""The HTTP layer of engine/server/ over a scripted engine, served by a real uvicorn on loopback.

The scripted engine has `engine.decode.generate`'s calling convention (on_tokens per round,
should_stop polled per round) and events to hold, watch and release a generation, so queueing,
cancellation and readiness are tested deterministically. The real model is driven in
tests/engine/server/test_e2e.py.
"""

from __future__ import annotations

import json
import os
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from engine.__main__ import main as engine_main
from engine.server.app import create_app
from engine.server.state import LoadedEngine, ServerConfig
from engine.tools import loadtest
from tests.helpers.scripted_server import (
    EOS,
    WAIT_S,
    ScriptedEngine,
    complete,
    loaded,
    running,
    serving,
    wait_until,
)

# -- generation -------------------------------------------------------------------------------


def test_completion_carries_text_usage_and_speculative_statistics(server, engine):
    url, _ = server
    body = complete(url, max_tokens=50).json()
    assert body["object"] == "text_completion"
    assert body["choices"][0]["text"] == "Hello world!"
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"] == {
        "prompt_tokens": 2,
        "completion_tokens": 13,
        "total_tokens": 15,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    spec = body["speculative"]
    assert (spec["method"], spec["budget"], spec["rounds"]) == ("auto", 15, 7)  # the default
    assert spec["mean_acceptance_length"] == pytest.approx(13 / 7)
    assert spec["budgets"] == {"mean": 1.0, "histogram": {"1": 7}}  # auto's chosen node counts
    named = complete(url, speculative={"method": "ddtree", "budget": 4}).json()["speculative"]
    assert (named["method"], named["budget"]) == ("ddtree", 4) and "budgets" not in named


def test_speculative_choice_per_request_else_server_default(server, engine):
    url, _ = server
    complete(url, temperature=0.5, seed=7, max_tokens=3)
    complete(url, speculative={"method": "linear"})
    complete(url, speculative={"method": "ddtree", "budget": 4})
    complete(url, speculative={"budget": 6})  # a budget named alone is ddtree's, exactly
    complete(url, speculative={"method": "auto", "budget": 8})  # auto's cap
    first, second, third, fourth, fifth = engine.configs[-5:]
    assert (first.method, first.budget, first.temperature, first.seed) == ("auto", 15, 0.5, 7)
    assert (first.max_new_tokens, first.stop_token_ids) == (3, (EOS,))
    assert (second.method, second.max_new_tokens) == ("linear", 16)  # OpenAI's default 16
    assert (third.method, third.budget) == ("ddtree", 4)
    assert (fourth.method, fourth.budget) == ("ddtree", 6)
    assert (fifth.method, fifth.budget) == ("auto", 8)


def test_chat_completion_uses_the_chat_template(server, engine):
    url, _ = server
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    body = httpx.post(url + "/v1/chat/completions", json={"messages": messages}).json()
    message = body["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "Hello world!", "refusal": None}
    assert body["usage"]["prompt_tokens"] == len("[user]hi[assistant]")
    # No max_tokens in chat: the rest of the context (64 tokens).
    assert engine.configs[-1].max_new_tokens == 64 - len("[user]hi[assistant]")


def test_a_stop_string_ends_the_generation_early(server, engine):
    url, _ = server
    body = complete(url, stop=[" wor"], max_tokens=50).json()
    assert body["choices"][0]["text"] == "Hello"
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] < len("Hello world!")  # stopped, not run out


def test_streamed_chunks_join_to_the_completion(server):
    url, _ = server
    with httpx.stream(
        "POST",
        url + "/v1/completions",
        json={"prompt": "hi", "stream": True, "stream_options": {"include_usage": True}},
    ) as response:
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [httpx.Response(200, content=line[len("data: ") :]).json() for line in lines[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == "Hello world!"
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-2]["speculative"]["rounds"] == 7
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 13


# -- bad input --------------------------------------------------------------------------------

BAD_BODIES = [
    (b"{not json", "invalid JSON"),
    (b"[1, 2]", "must be a JSON object"),
    (b'{"prompt": "hi", "max_tokens": -1}', "max_tokens: Input should be greater than or equal to"),
    (
        b'{"prompt": "hi", "max_tokens": -1}',
        "max_tokens: Input should be greater than or equal to 0",
    ),
    (b'{"prompt": "hi", "max_tokens": "ten"}', "max_tokens: Input should be a valid integer"),
    (b'{"prompt": "hi", "temperature": -0.5}', "temperature: Input should be greater than"),
    (b'{"prompt": 42}', "prompt"),
    (b'{"prompt": ""}', "prompt"),
    (b'{"max_tokens": 5}', "prompt: Field required"),
    (b'{"prompt": "hi", "speculative": {"method": "medusa"}}', "speculative.method"),
    (b'{"prompt": "hi", "speculative": {"budget": 0}}', "speculative.budget"),
    (b'{"prompt": "hi", "n": 129}', "n: Input should be less than or equal to 128"),
    (b'{"prompt": "hi", "n": 2, "best_of": 1}', "best_of: must be >= n (2), not 1"),
    (b'{"prompt": "hi", "best_of": 2, "stream": true}', "best_of: > n cannot be streamed"),
    (b'{"prompt": "hi", "logprobs": 6}', "logprobs: Input should be less than or equal to 5"),
    (b'{"prompt": "hi", "top_p": -0.1}', "top_p: Input should be greater than or equal to 0"),
    (b'{"prompt": [1, -3]}', "prompt token ids must be in"),
    (b'{"prompt": "hi", "seed": 9223372036854775808}', "seed: Input should be less than or equal"),
    (b'{"prompt": "hi", "seed": -9223372036854775809}', "seed: Input should be greater than"),
    (b'{"prompt": "hi", "seed": 1e30}', "seed: Input should be less than or equal"),
    (b'{"prompt": "hi", "seed": 0.5}', "seed: Input should be a valid integer"),
]


@pytest.mark.parametrize(("raw", "message"), BAD_BODIES)
def test_bad_input_is_a_400_with_a_clear_message(server, raw, message):
    url, _ = server
    response = httpx.post(url + "/v1/completions", content=raw)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert message in error["message"]
    assert error["type"] == "invalid_request_error"


def test_a_seed_is_bounded_to_64_bits_on_both_endpoints(server, engine):
    url, _ = server
    messages = [{"role": "user", "content": "hi"}]
    for seed in (2**63 - 1, -(2**63)):
        assert complete(url, seed=seed, temperature=1.0).status_code == 200
        assert engine.configs[-1].seed == seed
    refused = httpx.post(url + "/v1/chat/completions", json={"messages": messages, "seed": 2**64})
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "seed"


def test_context_limit_names_the_numbers(server):
    url, _ = server
    response = complete(url, prompt="x" * 60, max_tokens=5)
    assert response.status_code == 400
    error = response.json()["error"]
    assert "prompt has 60 tokens, max_tokens 5, limit 64" in error["message"]
    assert error["code"] == "context_length_exceeded"
    assert complete(url, prompt="x" * 59, max_tokens=5).status_code == 200  # exactly the limit


def test_a_drafter_method_without_a_drafter_is_refused():
    engine = ScriptedEngine()
    with running(engine, load=lambda: loaded(engine, has_drafter=False), default_method="ar") as (
        url,
        state,
    ):
        assert state.worker.ready.wait(WAIT_S)
        response = complete(url, speculative={"method": "ddtree"})
        assert response.status_code == 400
        assert "needs a drafter" in response.json()["error"]["message"]
        assert complete(url).json()["speculative"]["method"] == "ar"


# -- queue, cancellation, lifecycle -----------------------------------------------------------


def test_a_full_queue_answers_503(engine):
    with running(engine, max_waiting=1) as (url, state), ThreadPoolExecutor(2) as pool:
        assert state.worker.ready.wait(WAIT_S)
        engine.started.clear()
        engine.gate.clear()
        running_request = pool.submit(complete, url)
        assert engine.started.wait(WAIT_S)
        waiting_request = pool.submit(complete, url)
        wait_until(lambda: state.worker.waiting == 1)
        refused = complete(url)
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "queue_full"
        assert refused.headers["retry-after"] == "1"
        engine.gate.set()
        assert running_request.result().status_code == 200
        assert waiting_request.result().status_code == 200


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_disconnects_cancels_its_generation(server, engine, stream):
    url, _ = server
    engine.started.clear()
    engine.gate.clear()
    body = f'{{"prompt": "hi", "stream": {str(stream).lower()}}}'.encode()
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as client:
        client.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        assert engine.started.wait(WAIT_S)
    assert engine.cancelled.wait(WAIT_S), "the generation ran on after the client left"
    engine.gate.set()
    assert complete(url).status_code == 200  # the worker carries on


def test_health_answers_while_loading_and_ready_waits_for_the_warm_up():
    engine = ScriptedEngine()
    release = threading.Event()

    def slow_load() -> LoadedEngine:
        release.wait(WAIT_S)
        return loaded(engine)

    with running(engine, load=slow_load) as (url, state):
        assert httpx.get(url + "/health").json() == {"status": "ok"}
        assert httpx.get(url + "/ready").status_code == 503
        assert httpx.get(url + "/health", params={"ready": 1}).status_code == 503
        assert complete(url).json()["error"]["code"] == "not_ready"
        release.set()
        assert state.worker.ready.wait(WAIT_S)
        ready = {"status": "ready", "model": "tiny", "max_model_len": 64}
        assert httpx.get(url + "/ready").json() == ready
        assert engine.configs[0].max_new_tokens == 1  # the warm-up generation


def test_a_failed_load_is_reported_and_fatal():
    fatal = threading.Event()

    def broken_load() -> LoadedEngine:
        raise FileNotFoundError("no config.json in /models/x")

    app = create_app(broken_load, ServerConfig(model_name="x"), on_fatal=fatal.set)
    with serving(app) as url:
        assert fatal.wait(WAIT_S)
        ready = httpx.get(url + "/ready")
        assert ready.status_code == 503
        assert "no config.json in /models/x" in ready.json()["error"]


# -- auth and metrics -------------------------------------------------------------------------


def test_api_key_guards_everything_but_health(engine, caplog):
    secret = "s3cret-key"
    with running(engine, api_key=secret) as (url, state):
        assert state.worker.ready.wait(WAIT_S)
        assert httpx.get(url + "/health").status_code == 200
        assert httpx.get(url + "/ready").status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": secret}):
            response = httpx.get(url + "/v1/models", headers=headers)
            assert response.status_code == 401
            assert response.json()["error"]["code"] == "invalid_api_key"
        good = {"Authorization": f"Bearer {secret}"}
        assert httpx.get(url + "/v1/models", headers=good).json()["data"][0]["id"] == "tiny"
        assert httpx.get(url + "/metrics", headers=good).status_code == 200
    assert secret not in caplog.text


def test_metrics_parse_and_count_per_method(server):
    url, _ = server
    complete(url, speculative={"method": "linear"})
    complete(url, max_tokens=-1)
    complete(url)  # auto, the default: a node a round
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(url + "/metrics").text)}

    def value(family: str, sample: str, **labels) -> float:
        return sum(
            s.value
            for s in families[family].samples
            if s.name == sample and labels.items() <= s.labels.items()
        )

    assert value("ddops_engine_requests", "ddops_engine_requests_total", method="linear") == 1
    assert value("ddops_engine_errors", "ddops_engine_errors_total", status="400") == 1
    assert (
        value(
            "ddops_engine_generated_tokens", "ddops_engine_generated_tokens_total", method="linear"
        )
        == len("Hello world!") + 1
    )
    assert (
        value(
            "ddops_engine_acceptance_length",
            "ddops_engine_acceptance_length_count",
            method="linear",
        )
        == 7
    )
    budget = "ddops_engine_tree_budget"
    assert value(budget, budget + "_count", method="auto") == 7
    assert value(budget, budget + "_bucket", method="auto", le="0.0") == 0
    assert value(budget, budget + "_bucket", method="auto", le="1.0") == 7
    assert value(budget, budget + "_count", method="linear") == 0


def test_tokenize_counts_text_and_chat_messages(server):
    url, _ = server
    text = httpx.post(url + "/tokenize", json={"prompt": "abc"}).json()
    assert text == {"count": 3, "tokens": [97, 98, 99], "max_model_len": 64}
    messages = [{"role": "user", "content": "hi"}]
    chat = httpx.post(url + "/tokenize", json={"messages": messages}).json()
    assert chat["count"] == len("[user]hi[assistant]")
    both = httpx.post(url + "/tokenize", json={"prompt": "a", "messages": messages})
    assert both.status_code == 400


def test_the_loadtest_reports_a_clean_soak(server, capsys):
    url, _ = server
    requests = 24
    argv = [
        "--url",
        url,
        "--requests",
        str(requests),
        "--concurrency",
        "4",
        "--methods",
        "ar,ddtree",
    ]
    assert loadtest.main([*argv, "--pid", str(os.getpid())]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["statuses"] == {"200": requests}
    assert report["completion_tokens"] == requests * 8  # the default --max-tokens
    assert report["rss_mib"]["samples"] >= 1


def test_the_loadtest_fails_on_server_errors(engine, capsys):
    with running(engine, max_waiting=1) as (url, state):
        assert state.worker.ready.wait(WAIT_S)
        engine.gate.clear()  # one request holds the worker, one waits, the third gets a 503
        argv = ["--url", url, "--requests", "3", "--concurrency", "3", "--timeout", "2"]
        assert loadtest.main(argv) == 1
        engine.gate.set()
    report = json.loads(capsys.readouterr().out)
    assert report["statuses"]["503"] >= 1


@pytest.mark.parametrize(
    ("argv", "problem"),
    [
        (["--method", "ddtree"], "--method ddtree needs --draft"),
        (["--budget", "0"], "--budget and --max-waiting must be at least 1"),
        (["--max-model-len", "1"], "--max-model-len must be at least 2"),
    ],
)
def test_serve_refuses_bad_flags_before_loading_anything(tmp_path, capsys, argv, problem):
    assert engine_main(["serve", "--model", str(tmp_path), *argv]) == 2
    assert problem in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "env", "problem"),
    [
        (["--api-key", ""], None, "is empty"),
        ([], "", "is empty"),
        ([], "  ", "is empty"),
        (["--api-key", "k3y "], "good", "padded with whitespace"),
    ],
)
def test_serve_refuses_an_empty_api_key(tmp_path, capsys, monkeypatch, argv, env, problem):
    # An empty key used to mean "no authentication", silently: the server must not start.
    monkeypatch.setattr(uvicorn.Server, "run", lambda *a, **k: pytest.fail("the server started"))
    if env is None:
        monkeypatch.delenv("DDOPS_API_KEY", raising=False)
    else:
        monkeypatch.setenv("DDOPS_API_KEY", env)
    assert engine_main(["serve", "--model", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("Error: the API key")
    assert problem in err and "DDOPS_API_KEY" in err
