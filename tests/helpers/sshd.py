"""A real OpenSSH server on 127.0.0.1 for tests: key-only, its own host key, stopped by PID.

    from tests.helpers.sshd import running_sshd

    with running_sshd(tmp_path) as server:          # SshServer
        t = SSHTransport(server.host, port=server.port, user=server.user,
                         key_filename=str(server.client_key),
                         known_hosts=str(server.write_known_hosts(tmp_path / "known_hosts")))

or, one sshd for a whole test module, the `sshd_server` fixture of tests/conftest.py.

`running_ssh_agent(workdir, server.client_key)` yields an agent socket holding that key.
Needs /usr/sbin/sshd (openssh-server), ssh-keygen, ssh-agent; mark such tests `@pytest.mark.ssh`.
The server logs to memory (`server.log()`), which helps when a test fails.
"""

from __future__ import annotations

import contextlib
import getpass
import os
import socket
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

SSHD = "/usr/sbin/sshd"
READY_TIMEOUT_S = 20.0
_CONFIG = """\
Port {port}
ListenAddress 127.0.0.1
HostKey {host_key}
AuthorizedKeysFile {authorized_keys}
PidFile none
StrictModes no
UsePAM no
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin prohibit-password
Subsystem sftp internal-sftp
LogLevel INFO
"""


@dataclass
class SshServer:
    """A running sshd: where it listens, who may log in with which key, and its host key."""

    host: str
    port: int
    user: str
    client_key: Path
    host_public_key: str  # "ssh-ed25519 AAAA..."
    _log: list[str] = field(default_factory=list, repr=False)

    @property
    def known_hosts_line(self) -> str:
        return f"[{self.host}]:{self.port} {self.host_public_key}\n"

    @property
    def target(self) -> str:
        return f"ssh://{self.user}@{self.host}:{self.port}"

    def write_known_hosts(self, path: Path) -> Path:
        path.write_text(self.known_hosts_line)
        return path

    def log(self) -> str:
        return "\n".join(self._log)


def keygen(path: Path) -> Path:
    """A fresh passphrase-less ed25519 key pair at path (+ .pub)."""
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "ddops-test", "-f", str(path)],
        check=True,
    )
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_sshd(workdir: Path) -> Iterator[SshServer]:
    """Start sshd in workdir (keys, config, authorized_keys), yield it, stop it by PID."""
    workdir.mkdir(parents=True, exist_ok=True)
    os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege-separation dir
    host_key = keygen(workdir / "host_key")
    client_key = keygen(workdir / "client_key")
    authorized = workdir / "authorized_keys"
    authorized.write_text((workdir / "client_key.pub").read_text())
    port = free_port()
    config = workdir / "sshd_config"
    config.write_text(_CONFIG.format(port=port, host_key=host_key, authorized_keys=authorized))
    server = SshServer(
        host="127.0.0.1",
        port=port,
        user=getpass.getuser(),
        client_key=client_key,
        host_public_key=" ".join(host_key.with_suffix(".pub").read_text().split()[:2]),
    )
    proc = subprocess.Popen(
        [SSHD, "-D", "-e", "-f", str(config)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _await_listening(proc, server)
        yield server
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _await_listening(proc: subprocess.Popen, server: SshServer) -> None:
    """Block until sshd logs that it listens (or exits); drain its log while it runs."""
    settled = threading.Event()  # set when sshd listens or its stderr closes (it exited)

    def drain() -> None:
        for line in proc.stderr:
            server._log.append(line.rstrip("\n"))
            if "Server listening on" in line:
                settled.set()
        settled.set()

    threading.Thread(target=drain, daemon=True).start()
    settled.wait(READY_TIMEOUT_S)
    if not any("Server listening on" in line for line in server._log):
        raise RuntimeError(f"sshd did not start (exit {proc.poll()}):\n{server.log()}")


@contextlib.contextmanager
def running_ssh_agent(workdir: Path, *keys: Path) -> Iterator[str]:
    """An ssh-agent holding `keys`; yields its socket path (for SSH_AUTH_SOCK); stopped by PID."""
    sock = workdir / "agent.sock"
    proc = subprocess.Popen(["ssh-agent", "-D", "-a", str(sock)], stdout=subprocess.PIPE, text=True)
    try:
        proc.stdout.readline()  # "SSH_AUTH_SOCK=...": printed once the socket listens
        env = {**os.environ, "SSH_AUTH_SOCK": str(sock)}
        for key in keys:
            subprocess.run(["ssh-add", "-q", str(key)], env=env, check=True, capture_output=True)
        yield str(sock)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
