"""Run a real `python -m engine serve` process on a free loopback port, for tests.

    with engine_server(target_dir, draft_dir, api_key="k") as server:
        httpx.get(server.url + "/v1/models", headers=server.headers)

`start_engine_server` returns once `/ready` answers 200 (model loaded, warm-up generation done),
or raises `EngineServerError` with the server's log tail. `EngineServer.stop()` sends SIGTERM and
returns the exit code. The API key travels in the environment (DDOPS_API_KEY), never in argv.
Torch gets one CPU thread by default (OMP_NUM_THREADS=1): on a shared machine, tiny models run
far faster so than with threads contending for the cores.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

READY_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 30.0


class EngineServerError(RuntimeError):
    pass


@dataclass
class EngineServer:
    process: subprocess.Popen
    url: str  # http://127.0.0.1:PORT
    log_path: Path
    api_key: str | None = None

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM, wait for the exit; kill if it hangs. Returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_engine_server(
    model_dir: str | Path,
    draft_dir: str | Path | None = None,
    *,
    api_key: str | None = None,
    extra_args: Sequence[str] = (),
    log_path: str | Path | None = None,
    cpu_threads: int = 1,
    ready_timeout: float = READY_TIMEOUT_S,
) -> EngineServer:
    port = free_port()
    argv = [sys.executable, "-m", "engine", "serve", "--model", str(model_dir), "--port", str(port)]
    if draft_dir is not None:
        argv += ["--draft", str(draft_dir)]
    argv += list(extra_args)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(cpu_threads)}
    env.pop("DDOPS_API_KEY", None)
    if api_key:
        env["DDOPS_API_KEY"] = api_key
    log_path = Path(log_path or Path(model_dir).parent / f"engine-server-{port}.log")
    with log_path.open("wb") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
    server = EngineServer(process, f"http://127.0.0.1:{port}", log_path, api_key)
    try:
        _wait_until_ready(server, ready_timeout)
    except EngineServerError:
        server.stop()
        raise
    return server


@contextlib.contextmanager
def engine_server(model_dir, draft_dir=None, **options) -> Iterator[EngineServer]:
    server = start_engine_server(model_dir, draft_dir, **options)
    try:
        yield server
    finally:
        server.stop()


def serve_demo_pair(log_path: Path) -> Iterator[EngineServer]:
    """The shipped demo pair served for an agent's requests (a module fixture's body): it must
    stop cleanly at SIGTERM with no traceback in its log."""
    demo = Path(__file__).resolve().parents[2] / "engine" / "demo_model"
    extra = ["--max-model-len", "2048", "--budget", "8"]
    server = start_engine_server(
        demo / "target", demo / "draft", extra_args=extra, log_path=log_path
    )
    yield server
    assert server.stop() == -signal.SIGTERM
    assert "Traceback" not in server.log_text()


def _wait_until_ready(server: EngineServer, timeout: float) -> None:
    # A separate process offers no event to await: poll /ready until 200, exit, or timeout.
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise EngineServerError(
                f"engine server exited with {server.process.returncode}:\n{server.log_text()[-4000:]}"
            )
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(server.url + "/ready", timeout=2).status_code == 200:
                return
        time.sleep(0.2)
    raise EngineServerError(
        f"engine server not ready after {timeout} s:\n{server.log_text()[-4000:]}"
    )
