"""A TCP proxy on 127.0.0.1 that a test can cut or freeze, to play a failing network under SSH.

    with TcpProxy(("127.0.0.1", sshd_port)) as proxy:   # listen on proxy.port
        ...                                               # connect through it
        proxy.cut()      # close every connection (the peer sees FIN, as when a host reboots)
        proxy.freeze()   # stop forwarding but keep the sockets open (a silent network partition)

New connections after cut() are forwarded again; after freeze() they are accepted and then silent.
`silent_listener()` is the degenerate peer: it accepts TCP and never says a byte.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
from collections.abc import Iterator


class TcpProxy:
    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._pairs: list[tuple[socket.socket, socket.socket]] = []
        self._frozen = threading.Event()
        self._stopped = threading.Event()
        self._lock = threading.Lock()

    def __enter__(self) -> TcpProxy:
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._stopped.set()
        self._listener.close()
        self.cut()

    def cut(self) -> None:
        with self._lock:
            pairs, self._pairs = self._pairs, []
        for pair in pairs:
            for sock in pair:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()

    def freeze(self) -> None:
        self._frozen.set()

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            with self._lock:
                self._pairs.append((client, server))
            threading.Thread(target=self._pump, args=(client, server), daemon=True).start()

    def _pump(self, a: socket.socket, b: socket.socket) -> None:
        peers = {a: b, b: a}
        while not self._stopped.is_set():
            try:
                ready, _, _ = select.select(list(peers), [], [], 0.1)
                if self._frozen.is_set():
                    self._stopped.wait(0.1)
                    continue  # hold the bytes: neither side hears anything
                for sock in ready:
                    data = sock.recv(65536)
                    if not data:
                        raise OSError("closed")
                    peers[sock].sendall(data)
            except (OSError, ValueError):
                for sock in peers:
                    sock.close()
                return


@contextlib.contextmanager
def silent_listener() -> Iterator[int]:
    """A port that accepts TCP connections and never sends a byte; yields the port."""
    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                accepted.append(listener.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        listener.close()
        for sock in accepted:
            sock.close()
