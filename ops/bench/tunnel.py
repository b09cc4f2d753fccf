"""Reach a remote engine from the bench client: a local port forwarded over SSH (paramiko).

    with engine_tunnel(ssh_transport, vmid=200, python="/opt/ddops/venv/bin/python", port=8000) as fwd:
        EngineClient(fwd.url)                          # http://127.0.0.1:<local port>

The engine listens on 127.0.0.1 inside its CT, which the Proxmox host cannot reach by address,
so each forwarded connection opens an SSH exec channel running `pct exec VMID -- PYTHON -c
RELAY PORT`: a stdlib relay inside the CT between its stdin/stdout and 127.0.0.1:PORT.
`direct_tcpip` is the classic `ssh -L` channel, for an engine the SSH host reaches by address.
Each connection's bytes are pumped both ways on its own thread until either side closes.
"""

from __future__ import annotations

import contextlib
import logging
import select
import socket
import threading
from collections.abc import Callable, Iterator, Sequence

import paramiko

from ops.errors import DdopsError
from ops.host.pve import validate_vmid
from ops.host.ssh import SSHTransport

log = logging.getLogger(__name__)

_CHUNK = 65536
# Run by the CT's python: relay stdin/stdout to 127.0.0.1:PORT (argv[1]) until either side ends.
RELAY = """\
import socket, sys, threading
conn = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
def upstream():
    while data := sys.stdin.buffer.read1(65536):
        conn.sendall(data)
    conn.shutdown(socket.SHUT_WR)
threading.Thread(target=upstream, daemon=True).start()
while data := conn.recv(65536):
    sys.stdout.buffer.write(data)
    sys.stdout.buffer.flush()
"""

OpenChannel = Callable[[tuple[str, int]], paramiko.Channel]  # (the local peer) -> a new channel


def direct_tcpip(t: SSHTransport, host: str, port: int) -> OpenChannel:
    """Channels to host:port as the SSH host sees it (a plain local port forward)."""
    return lambda peer: t.connection().open_channel("direct-tcpip", (host, port), peer)


def exec_relay(t: SSHTransport, argv: Sequence[str]) -> OpenChannel:
    """Channels whose bytes go to the stdin/stdout of `argv`, run on the SSH host per channel."""

    def open_channel(peer: tuple[str, int]) -> paramiko.Channel:
        channel = t.connection().open_session()
        channel.exec_command(t.remote_command(argv))
        return channel

    return open_channel


def ct_relay_argv(vmid: int | str, python: str, port: int) -> list[str]:
    """The command that relays a channel to 127.0.0.1:port inside CT `vmid`."""
    return ["pct", "exec", validate_vmid(vmid), "--", python, "-c", RELAY, str(port)]


class LocalForward:
    """A listening socket on 127.0.0.1:<free port>; each connection gets its own channel."""

    def __init__(self, open_channel: OpenChannel, label: str) -> None:
        self.label = label
        self._open_channel = open_channel
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._closed = threading.Event()
        self._acceptor = threading.Thread(target=self._accept, name="bench-tunnel", daemon=True)
        self._acceptor.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> LocalForward:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        self._listener.close()
        self._acceptor.join(timeout=5)

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, peer = self._listener.accept()
            except OSError:
                return  # closed
            try:
                channel = self._open_channel(peer)
            except (paramiko.SSHException, DdopsError, OSError) as exc:
                log.warning("%s: cannot open a channel: %s", self.label, exc)
                client.close()
                continue
            threading.Thread(target=_pump, args=(client, channel), daemon=True).start()


def _pump(client: socket.socket, channel: paramiko.Channel) -> None:
    """Copy bytes both ways until one side closes, then close both."""
    try:
        while True:
            readable, _, _ = select.select([client, channel], [], [])
            if client in readable:
                data = client.recv(_CHUNK)
                if not data:
                    break
                channel.sendall(data)
            if channel in readable:
                data = channel.recv(_CHUNK)
                if not data:
                    break
                client.sendall(data)
    except OSError:
        pass  # a reset on either side ends this connection only
    finally:
        channel.close()
        client.close()


@contextlib.contextmanager
def engine_tunnel(t: SSHTransport, *, vmid: int, python: str, port: int) -> Iterator[LocalForward]:
    """A local URL for the engine listening on 127.0.0.1:port inside CT `vmid` of host `t`."""
    forward = LocalForward(exec_relay(t, ct_relay_argv(vmid, python, port)), f"{t.label} CT {vmid}")
    try:
        yield forward
    finally:
        forward.close()
