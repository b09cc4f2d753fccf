"""The bench's SSH tunnel over a real sshd on loopback: HTTP through a direct-tcpip forward and
through the exec relay that `pct exec` runs inside a CT (here run on the SSH host itself).

    python -m pytest -q tests/integration/test_bench_tunnel.py
"""

from __future__ import annotations

import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from ops.bench.tunnel import RELAY, LocalForward, ct_relay_argv, direct_tcpip, exec_relay
from ops.errors import DdopsError
from ops.host.ssh import SSHTransport
from tests.helpers.sshd import running_sshd

pytestmark = pytest.mark.ssh

BIG = b"0123456789abcdef" * 65536  # 1 MiB: many channel windows


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = BIG if self.path == "/big" else f"hello {self.path}".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body[::-1])

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def web():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def ssh(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("sshd")
    with running_sshd(workdir) as server:
        t = SSHTransport(
            server.host,
            port=server.port,
            user=server.user,
            key_filename=str(server.client_key),
            known_hosts=str(server.write_known_hosts(workdir / "known_hosts")),
        )
        yield t
        t.close()


def exchange(url: str) -> None:
    """Several connections, a large answer and a request body, through the forward."""
    for path in ("/a", "/b"):
        with httpx.Client(base_url=url, timeout=30) as http:  # a new connection each time
            assert http.get(path).text == f"hello {path}"
    with httpx.Client(base_url=url, timeout=30) as http:
        assert http.get("/big").content == BIG
        assert http.post("/echo", content=b"tunnel").content == b"lennut"


def test_a_direct_tcpip_forward_carries_http(ssh, web):
    with LocalForward(direct_tcpip(ssh, "127.0.0.1", web), "test") as forward:
        assert forward.url == f"http://127.0.0.1:{forward.port}"
        exchange(forward.url)


def test_the_exec_relay_carries_http(ssh, web):
    argv = [sys.executable, "-c", RELAY, str(web)]  # what `pct exec VMID --` runs in a CT
    with LocalForward(exec_relay(ssh, argv), "test") as forward:
        exchange(forward.url)


def test_the_ct_relay_runs_through_pct_exec_with_a_checked_vmid():
    argv = ct_relay_argv(200, "/opt/ddops/venv/bin/python", 8000)
    assert argv[:6] == ["pct", "exec", "200", "--", "/opt/ddops/venv/bin/python", "-c"]
    assert argv[6:] == [RELAY, "8000"]
    with pytest.raises(DdopsError):
        ct_relay_argv("200; reboot", "/usr/bin/python3", 8000)


def test_a_closed_forward_refuses_new_connections(ssh, web):
    forward = LocalForward(direct_tcpip(ssh, "127.0.0.1", web), "test")
    forward.close()
    with pytest.raises(httpx.ConnectError):
        httpx.get(forward.url + "/a", timeout=5)
