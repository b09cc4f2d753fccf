"""The engine's health probe (ops/agents/engine_probe.py) against a scripted local HTTP server.

    python -m pytest -q tests/ops/agents/test_engine_probe.py

Each case scripts what /ready, /v1/completions and /v1/models answer, runs the probe's main and
reads its one line; the last runs it as ops/chain/deploy.py does, from stdin.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from ops.agents import engine_probe
from ops.chain.deploy import API_KEY_ENV, ENGINE_PROBE

GOOD = {"choices": [{"text": " world"}], "usage": {"completion_tokens": 4}}


class Engine:
    """Routes -> (status, JSON body); a route that checks the key answers 401 without it."""

    def __init__(self) -> None:
        self.routes = {"/ready": (200, {"status": "ready"}), "/v1/completions": (200, GOOD)}
        self.key: str | None = None  # the Bearer token /v1/models requires, when set
        self.seen: list[tuple[str, str | None]] = []  # (path, Authorization)
        self.loading = 0  # how many more times /ready answers 503 (the engine is loading)

    def answer(self, path: str, authorization: str | None) -> tuple[int, dict]:
        self.seen.append((path, authorization))
        if path == "/ready" and self.loading:
            self.loading -= 1
            return 503, {"status": "loading"}
        if path == "/v1/models":
            refused = self.key and authorization != f"Bearer {self.key}"
            return (401, {"error": {"message": "no key"}}) if refused else (200, {"data": []})
        return self.routes[path]


def serve(scripted: Engine, port: int = 0) -> ThreadingHTTPServer:
    """A local HTTP server answering as `scripted` says, serving on a thread."""

    class Handler(BaseHTTPRequestHandler):
        def _reply(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            self.rfile.read(length)
            status, body = scripted.answer(self.path, self.headers.get("Authorization"))
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = _reply

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture
def engine() -> Iterator[tuple[Engine, int]]:
    scripted = Engine()
    server = serve(scripted)
    yield scripted, server.server_address[1]
    server.shutdown()
    server.server_close()


def env_file(tmp_path: Path, key: str | None) -> str:
    path = tmp_path / "engine.env"
    path.write_text(f"# the engine's key\n{API_KEY_ENV}={key}\n" if key else "# no key\n")
    return str(path)


def probe(capsys, port: int, env: str, *options: str) -> tuple[int, str]:
    code = engine_probe.main([str(port), env, "5", API_KEY_ENV, *options])
    return code, capsys.readouterr().out.strip()


def test_a_healthy_engine_that_requires_its_key(engine, tmp_path, capsys):
    scripted, port = engine
    scripted.key = "s3cret"
    code, line = probe(capsys, port, env_file(tmp_path, "s3cret"))
    assert code == 0
    assert json.loads(line) == {
        "text": " world",
        "usage": {"completion_tokens": 4},
        "key_installed": True,
        "key_required": True,
    }
    assert ("/v1/completions", "Bearer s3cret") in scripted.seen
    assert ("/v1/models", None) in scripted.seen  # asked without the key


def test_without_a_key_the_engine_need_not_require_one(engine, tmp_path, capsys):
    _, port = engine
    code, line = probe(capsys, port, str(tmp_path / "absent.env"))
    assert code == 0
    assert (json.loads(line)["key_installed"], json.loads(line)["key_required"]) == (False, False)


def test_an_engine_that_ignores_the_installed_key_is_unhealthy(engine, tmp_path, capsys):
    _, port = engine  # /v1/models answers 200 to anyone
    assert probe(capsys, port, env_file(tmp_path, "s3cret")) == (
        1,
        "the engine ignores the installed API key: /v1/models answered 200 without it",
    )


@pytest.mark.parametrize(
    ("route", "answer", "line"),
    [
        ("/ready", (503, {"status": "loading"}), "/ready answered 503 (loading)"),
        ("/ready", (500, {}), "/ready answered 500 (no reason given)"),
        (
            "/v1/completions",
            (400, {"error": {"message": "prompt too long"}}),
            "/v1/completions answered 400 (prompt too long)",
        ),
        (
            "/v1/completions",
            (200, {"choices": [{"text": "x"}], "usage": {}}),
            '/v1/completions answered without text or usage: {"choices": [{"text": "x"}], '
            '"usage": {}}',
        ),
    ],
)
def test_what_is_wrong_is_one_line(engine, tmp_path, capsys, route, answer, line):
    scripted, port = engine
    scripted.routes[route] = answer
    assert probe(capsys, port, env_file(tmp_path, None)) == (1, line)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again: nothing listens there


def test_nothing_listening_is_named(tmp_path, capsys):
    port = _closed_port()
    code, line = probe(capsys, port, env_file(tmp_path, None))
    assert code == 1 and line.startswith(f"nothing answers on http://127.0.0.1:{port} (")


def test_it_runs_from_stdin_as_deploy_sends_it(engine, tmp_path):
    """As ops/chain/deploy.py's engine_health runs it in a CT: `python - ARGS` < the module."""
    _, port = engine
    argv = [sys.executable, "-", str(port), env_file(tmp_path, None), "5", API_KEY_ENV]
    done = subprocess.run(argv, input=ENGINE_PROBE.read_text(), capture_output=True, text=True)
    assert (done.returncode, done.stderr) == (0, "")
    assert json.loads(done.stdout)["text"] == " world"


def test_with_wait_a_loading_engine_is_asked_again_until_ready(engine, tmp_path, capsys):
    scripted, port = engine
    scripted.loading = 3
    code, line = probe(capsys, port, env_file(tmp_path, None), "--wait", "10")
    assert (code, json.loads(line)["text"]) == (0, " world")
    assert [path for path, _ in scripted.seen].count("/ready") == 4  # 3 x 503, then 200


def test_with_wait_an_engine_not_listening_yet_is_waited_for(tmp_path, capsys):
    port = _closed_port()
    servers: list[ThreadingHTTPServer] = []
    later = threading.Timer(0.4, lambda: servers.append(serve(Engine(), port)))  # binds late
    later.start()
    try:
        code, line = probe(capsys, port, env_file(tmp_path, None), "--wait", "10")
    finally:
        later.join()
        for server in servers:
            server.shutdown()
            server.server_close()
    assert (code, json.loads(line)["text"]) == (0, " world")


def test_with_wait_only_starting_is_waited_for_and_the_wait_ends(engine, tmp_path, capsys):
    scripted, port = engine
    scripted.routes["/ready"] = (500, {})  # broken, not starting: final at once
    assert probe(capsys, port, env_file(tmp_path, None), "--wait", "30")[1] == (
        "/ready answered 500 (no reason given)"
    )
    assert [path for path, _ in scripted.seen] == ["/ready"]
    scripted.loading = 10**6  # loading for good: the last answer once the wait is over
    start = time.monotonic()
    code, line = probe(capsys, port, env_file(tmp_path, None), "--wait", "0.5")
    assert (code, line) == (1, "/ready answered 503 (loading)")
    assert time.monotonic() - start < 5
