"""SSHTransport: the Transport seam over paramiko, for a real Proxmox host.

    t = SSHTransport("pve1.example.org", user="root")       # keys from ssh-agent / ~/.ssh
    t.run(["pct", "status", "200"])                         # Result(rc, stdout, stderr)
    t.write_file("/etc/pve/lxc/200.conf", text)             # SFTP: temp + fsync + posix-rename
    t.close()

Host keys are checked against known_hosts (`~/.ssh/known_hosts` unless another file is given):
an unknown key is refused with its fingerprint unless `accept_new_host_key=True`, which
records it; a changed key is always refused. One SSH connection (and one SFTP session) serves
every call of a transport. Commands are sent as `shlex.join(argv)`; env values travel on stdin
to a constant wrapper (`ops.transport.env_via_stdin`), never on the remote command line. With
`sysroot`, paths map below it and the remote PATH starts with its bin directories, as in
LocalTransport. Tests: tests/test_ssh_transport.py (a real sshd on loopback).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import select
import shlex
import socket
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import paramiko

from ops.errors import DdopsError
from ops.transport import (
    SYSROOT_BIN_DIRS,
    CommandTimeout,
    Result,
    Transport,
    env_via_stdin,
)

DEFAULT_KNOWN_HOSTS = "~/.ssh/known_hosts"
# A constant script: put $1 in front of PATH, then exec the rest of the argv.
_PATH_PREFIX_SCRIPT = 'PATH="$1:$PATH"; export PATH; shift; exec "$@"'
_READ_CHUNK = 65536
KEEPALIVE_S = 30


def known_hosts_name(host: str, port: int) -> str:
    """How OpenSSH names a host in known_hosts: `host`, or `[host]:port` off port 22."""
    return host if port == 22 else f"[{host}]:{port}"


class _KnownHostsPolicy(paramiko.MissingHostKeyPolicy):
    """Refuse a host key missing from known_hosts, or record it when explicitly allowed."""

    def __init__(self, label: str, known_hosts: Path, accept_new: bool) -> None:
        self.label = label
        self.known_hosts = known_hosts
        self.accept_new = accept_new

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey):
        described = f"{key.get_name()} {key.fingerprint}"
        if not self.accept_new:
            raise DdopsError(
                self.label,
                f"unknown host key {described} (not in {self.known_hosts}); check it, then "
                "connect once with --accept-new-host-key to record it",
            )
        self.known_hosts.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        with open(self.known_hosts, "a", opener=_private_opener) as f:
            f.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")
        client.get_host_keys().add(hostname, key.get_name(), key)


def _private_opener(path: str, flags: int) -> int:
    return os.open(path, flags, 0o600)


class SSHTransport(Transport):
    """A host reached over SSH (paramiko); lazily connected, one connection per transport."""

    def __init__(
        self,
        host: str,
        *,
        port: int = 22,
        user: str = "root",
        key_filename: str | None = None,
        known_hosts: str | None = None,
        accept_new_host_key: bool = False,
        sysroot: str | None = None,
        connect_timeout: float = 10.0,
    ) -> None:
        bracketed = f"[{host}]" if ":" in host else host  # an IPv6 address
        label = f"ssh://{user}@{bracketed}" + (f":{port}" if port != 22 else "")
        super().__init__(label, sysroot)
        self.host, self.port, self.user = host, port, user
        self.key_filename = key_filename
        self.known_hosts = Path(os.path.expanduser(known_hosts or DEFAULT_KNOWN_HOSTS))
        self.accept_new_host_key = accept_new_host_key
        self.connect_timeout = connect_timeout
        self._client: paramiko.SSHClient | None = None
        self._sftp_client: paramiko.SFTPClient | None = None

    # -- connection ---------------------------------------------------------------------------
    def _connection(self) -> paramiko.Transport:
        """The live SSH connection, opened on first use and reopened if it dropped."""
        if self._client is not None:
            live = self._client.get_transport()
            if live is not None and live.is_active():
                return live
            self.close()
        client = paramiko.SSHClient()
        if self.known_hosts.exists():
            client.load_host_keys(str(self.known_hosts))
        client.set_missing_host_key_policy(
            _KnownHostsPolicy(self.label, self.known_hosts, self.accept_new_host_key)
        )
        try:
            self._connect(client)
        except BaseException:
            client.close()
            raise
        self._client = client
        connection = client.get_transport()
        connection.set_keepalive(KEEPALIVE_S)  # long bench runs: keep idle NAT/firewall state
        return connection

    def _connect(self, client: paramiko.SSHClient) -> None:
        """client.connect, with each way it can fail turned into a DdopsError naming the host."""
        try:
            client.connect(
                self.host,
                port=self.port,
                username=self.user,
                key_filename=self.key_filename,
                allow_agent=True,
                look_for_keys=self.key_filename is None,
                timeout=self.connect_timeout,
                banner_timeout=self.connect_timeout,
                auth_timeout=self.connect_timeout,
            )
        except paramiko.BadHostKeyException as exc:
            raise DdopsError(
                self.label,
                f"host key CHANGED: server offers {exc.key.get_name()} {exc.key.fingerprint}, "
                f"{self.known_hosts} has {exc.expected_key.fingerprint}; refusing (possible "
                f"man-in-the-middle). If the change is expected: ssh-keygen -R "
                f"'{known_hosts_name(self.host, self.port)}'",
            ) from exc
        except paramiko.AuthenticationException as exc:
            tried = f"key file {self.key_filename}" if self.key_filename else "~/.ssh keys"
            raise DdopsError(
                self.label, f"authentication failed for user {self.user} ({tried}, ssh-agent)"
            ) from exc
        except socket.gaierror as exc:
            raise DdopsError(self.label, f"unreachable: cannot resolve {self.host!r}") from exc
        except paramiko.ssh_exception.NoValidConnectionsError as exc:
            raise DdopsError(
                self.label, f"unreachable: connection refused on port {self.port}"
            ) from exc
        except TimeoutError as exc:
            raise DdopsError(
                self.label, f"unreachable: no answer within {self.connect_timeout:g}s"
            ) from exc
        except paramiko.SSHException as exc:
            raise DdopsError(self.label, f"SSH handshake failed: {exc}") from exc
        except OSError as exc:
            raise DdopsError(self.label, f"unreachable: {exc.strerror or exc}") from exc

    def connection(self) -> paramiko.Transport:
        """The live SSH connection, for channels of one's own (ops/bench/tunnel.py forwards)."""
        return self._connection()

    def _sftp(self) -> paramiko.SFTPClient:
        connection = self._connection()  # a dropped connection resets the SFTP session too
        if self._sftp_client is None:
            self._sftp_client = paramiko.SFTPClient.from_transport(connection)
        return self._sftp_client

    def close(self) -> None:
        if self._sftp_client is not None:
            self._sftp_client.close()
            self._sftp_client = None
        if self._client is not None:
            self._client.close()
            self._client = None

    def _session(self) -> paramiko.Channel:
        """A new channel on the shared connection (a fresh connection if it dropped)."""
        try:
            return self._connection().open_session(timeout=self.connect_timeout)
        except (paramiko.SSHException, EOFError, ConnectionError) as exc:
            raise DdopsError(self.label, f"SSH connection lost: {exc}") from exc

    # -- commands -----------------------------------------------------------------------------
    def remote_command(self, argv: Sequence[str]) -> str:
        """The command line sent to the remote shell for argv (sysroot bins first on PATH)."""
        if self.sysroot:
            prefix = ":".join(f"{self.sysroot}/{d}" for d in SYSROOT_BIN_DIRS)
            argv = ["sh", "-c", _PATH_PREFIX_SCRIPT, "ddops-path", prefix, *argv]
        return shlex.join(argv)

    def run(
        self,
        argv: Sequence[str],
        *,
        timeout: float | None = 60.0,
        input: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> Result:
        argv = tuple(str(a) for a in argv)
        remote_argv, stdin = env_via_stdin(argv, env, input) if env else (argv, input)
        channel = self._session()
        try:
            channel.exec_command(self.remote_command(remote_argv))
            if stdin:
                channel.sendall(stdin.encode())
            channel.shutdown_write()
            rc, out, err = _collect(channel, timeout)
        except TimeoutError as exc:
            # Closing the channel stops waiting; a command that ignores its closed pipes may
            # still finish on its own remotely.
            raise CommandTimeout(
                self.label, f"`{shlex.join(argv)}` timed out after {timeout:g}s"
            ) from exc
        except (paramiko.SSHException, EOFError, ConnectionError) as exc:
            raise DdopsError(self.label, f"SSH connection lost during `{argv[0]}`: {exc}") from exc
        finally:
            channel.close()
        return Result(argv, rc, out.decode(errors="replace"), err.decode(errors="replace"))

    # -- files (SFTP) -------------------------------------------------------------------------
    def _read(self, real_path: str) -> bytes:
        with self._sftp().open(real_path, "rb") as f:
            return f.read()

    def _write_atomic(self, real_path: str, data: bytes, mode: int) -> None:
        sftp = self._sftp()
        directory = os.path.dirname(real_path)
        _makedirs(sftp, directory)
        tmp = f"{directory}/.ddops-{secrets.token_hex(6)}"
        try:
            with sftp.open(tmp, "wb") as f:
                f.chmod(mode)  # before any byte lands, so a secret is never world-readable
                f.write(data)
            self.run(["sync", "--", tmp]).check(self.label)  # fsync the file (coreutils)
            sftp.posix_rename(tmp, real_path)
        except BaseException:
            with contextlib.suppress(OSError):
                sftp.remove(tmp)
            raise

    def _stat_mode(self, real_path: str) -> int | None:
        try:
            return self._sftp().stat(real_path).st_mode & 0o7777
        except FileNotFoundError:
            return None


def _collect(channel: paramiko.Channel, timeout: float | None) -> tuple[int, bytes, bytes]:
    """Read stdout and stderr until the remote command exits; TimeoutError past `timeout`."""
    deadline = None if timeout is None else time.monotonic() + timeout
    out, err = bytearray(), bytearray()
    while True:
        while channel.recv_ready():
            out += channel.recv(_READ_CHUNK)
        while channel.recv_stderr_ready():
            err += channel.recv_stderr(_READ_CHUNK)
        if channel.eof_received and not channel.recv_ready() and not channel.recv_stderr_ready():
            break
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            raise TimeoutError
        select.select([channel], [], [], remaining)  # the channel signals new data or EOF
    remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
    if not channel.status_event.wait(remaining):
        raise TimeoutError
    return channel.recv_exit_status(), bytes(out), bytes(err)


def _makedirs(sftp: paramiko.SFTPClient, directory: str) -> None:
    """mkdir -p over SFTP."""
    missing = []
    path = directory
    while path not in ("", "/"):
        try:
            sftp.stat(path)
            break
        except FileNotFoundError:
            missing.append(path)
            path = os.path.dirname(path)
    for path in reversed(missing):
        sftp.mkdir(path)
