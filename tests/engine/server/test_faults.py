"""The engine server under oversized and slow requests: the body limit (413) and request bodies
prepared off the event loop, over a scripted engine served by a real uvicorn on loopback.

Shutdown with requests in flight is in tests/engine/server/test_shutdown.py.
"""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from engine.server.body import DEFAULT_MAX_REQUEST_BYTES
from engine.server.state import LoadedEngine
from engine.tokenizer import load_tokenizer
from tests.helpers.scripted_server import WAIT_S, CharTokenizer, ScriptedEngine, complete, running
from tests.helpers.tiny_tokenizer import save_byte_tokenizer

LIMIT = 4096
MESSAGES = [{"role": "user", "content": "hi"}]


def with_tokenizer(engine: ScriptedEngine, tokenizer) -> LoadedEngine:
    return LoadedEngine(engine.generate, tokenizer, 64, 0x110000, True)


def padded_body(size: int) -> bytes:
    """A valid completion body of exactly `size` bytes (JSON whitespace as padding)."""
    body = b'{"prompt": "hi", "max_tokens": 3}'
    return body[:-1] + b" " * (size - len(body)) + b"}"


def assert_too_large(response: httpx.Response, limit: int) -> None:
    assert response.status_code == 413, response.text
    error = response.json()["error"]
    assert error["code"] == "request_too_large"
    assert f"at most {limit} bytes" in error["message"]


# -- the body limit ---------------------------------------------------------------------------


@pytest.fixture
def limited():
    engine = ScriptedEngine()
    with running(engine, max_request_bytes=LIMIT) as (url, state):
        assert state.worker.ready.wait(WAIT_S)
        yield url


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
def test_a_body_over_the_limit_is_a_413_naming_it(limited, path):
    assert_too_large(httpx.post(limited + path, content=padded_body(LIMIT + 1)), LIMIT)


def test_a_body_at_the_limit_is_served(limited):
    response = httpx.post(limited + "/v1/completions", content=padded_body(LIMIT))
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == "Hel"


def test_a_chunked_body_is_cut_once_it_passes_the_limit(limited):
    def chunks():  # no Content-Length: the server learns the size only by reading
        body = padded_body(4 * LIMIT)
        for start in range(0, len(body), 1024):
            yield body[start : start + 1024]

    response = httpx.post(limited + "/v1/completions", content=chunks(), timeout=WAIT_S)
    assert "content-length" not in response.request.headers
    assert_too_large(response, LIMIT)


def test_the_default_limit_refuses_a_large_body_before_reading_it():
    engine = ScriptedEngine()
    with running(engine) as (url, state):
        assert state.worker.ready.wait(WAIT_S)
        body = padded_body(DEFAULT_MAX_REQUEST_BYTES + 1)
        assert_too_large(httpx.post(url + "/v1/completions", content=body, timeout=WAIT_S), 8 << 20)
        assert complete(url).status_code == 200  # the server carries on


# -- request bodies off the event loop ----------------------------------------------------------


class RecordingTokenizer(CharTokenizer):
    """Records the thread that renders and encodes each prompt."""

    def __init__(self) -> None:
        self.threads: list[str] = []

    def encode(self, text: str) -> list[int]:
        self.threads.append(threading.current_thread().name)
        return super().encode(text)

    def render_chat(self, messages, add_generation_prompt=True, **inputs) -> str:
        self.threads.append(threading.current_thread().name)
        return super().render_chat(messages, add_generation_prompt, **inputs)


class GatedTokenizer(CharTokenizer):
    """Encoding a text with "slow" in it waits until `release` is set."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def encode(self, text: str) -> list[int]:
        if "slow" in text:
            self.entered.set()
            self.release.wait(3 * WAIT_S)
        return super().encode(text)


def test_prompts_are_rendered_and_tokenised_off_the_event_loop():
    engine, tokenizer = ScriptedEngine(), RecordingTokenizer()
    with running(engine, load=lambda: with_tokenizer(engine, tokenizer)) as (url, state):
        assert state.worker.ready.wait(WAIT_S)
        tokenizer.threads.clear()  # the warm-up encodes on the worker
        assert complete(url).status_code == 200
        assert httpx.post(url + "/v1/chat/completions", json={"messages": MESSAGES}).is_success
        assert httpx.post(url + "/tokenize", json={"messages": MESSAGES}).is_success
        assert httpx.post(url + "/tokenize", json={"prompt": "abc"}).is_success
    assert len(tokenizer.threads) == 6  # 1 + (render, encode) x 2 + 1
    assert {name.split("_")[0] for name in tokenizer.threads} == {"engine-prepare"}


def test_health_and_other_requests_answer_while_a_prompt_is_tokenised():
    engine, tokenizer = ScriptedEngine(), GatedTokenizer()
    load = lambda: with_tokenizer(engine, tokenizer)  # noqa: E731
    with running(engine, load=load) as (url, state), ThreadPoolExecutor(1) as pool:
        assert state.worker.ready.wait(WAIT_S)
        try:
            slow = pool.submit(complete, url, prompt="slow", max_tokens=3)
            assert tokenizer.entered.wait(WAIT_S)
            # Were the prompt tokenised on the event loop, these would wait for it.
            assert httpx.get(url + "/health", timeout=WAIT_S).json() == {"status": "ok"}
            assert complete(url, max_tokens=3).json()["choices"][0]["text"] == "Hel"
            assert not slow.done()
        finally:
            tokenizer.release.set()
        assert slow.result().status_code == 200


def test_the_tokenizer_lets_other_threads_run_while_it_encodes(tmp_path):
    # HF tokenizers' encode holds the GIL throughout (a thread pool alone would not free the
    # event loop); encode_batch releases it. Proof without timing: the main thread takes
    # timestamps while another thread is inside encode (holding the GIL, it gets at most the
    # one or two at the span's edges, where the thread runs Python).
    tokenizer = load_tokenizer(save_byte_tokenizer(tmp_path))
    rng = random.Random(0)
    words = [
        "".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(2, 9))) for _ in range(5000)
    ]
    text = " ".join(rng.choices(words, k=40000))  # ~240 kB: about 0.5 s with this tokenizer
    span: dict[str, float] = {}

    def encode() -> None:
        span["start"] = time.perf_counter()
        span["ids"] = len(tokenizer.encode(text))
        span["end"] = time.perf_counter()

    worker = threading.Thread(target=encode)
    stamps = []
    worker.start()
    while worker.is_alive():
        time.sleep(0.001)
        stamps.append(time.perf_counter())
    worker.join()
    assert span["ids"] > len(text) // 8
    assert sum(span["start"] < stamp < span["end"] for stamp in stamps) >= 10
