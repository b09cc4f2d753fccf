"""SSHTransport: the Transport seam over paramiko, for a real Proxmox host.

    t = SSHTransport("pve1.example.org", user="root")       # keys from ssh-agent / ~/.ssh
    t.run(["pct", "status", "200"])                         # Result(rc, stdout, stderr)
    t.write_file("/etc/pve/lxc/200.conf", text)             # SFTP: temp + fsync + posix-rename
    t.close()

Host keys are checked against known_hosts (`~/.ssh/known_hosts` unless another file is given):
an unknown key is refused with its fingerprint unless `accept_new_host_key=True`, which
records it; a changed key is always refused. One SSH connection (and one SFTP session) serves
every call of a transport. Commands are sent as `shlex.join(argv)`; env values travel on stdin
to a constant wrapper (`ops.host.transport.env_via_stdin`), never on the remote command line. With
`sysroot`, paths map below it and the remote PATH starts with its bin directories, as in
LocalTransport. Tests: tests/integration/test_ssh_transport.py (a real sshd on loopback).

Faults are named, never waited out: while a command runs, a connection that closed is reported
lost at once, and one that went silent (no data, no answer to an SSH keepalive request within
`keepalive_s` + `liveness_s`) is closed and reported lost, long before the command's own timeout.
Every SFTP call has a timeout (`sftp_timeout_s`); its failures are DdopsErrors naming the path
(a missing file stays FileNotFoundError, which callers test for). A peer that accepts TCP but
never speaks SSH is one error after `connect_timeout`.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import select
import shlex
import socket
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import paramiko

from ops.errors import DdopsError
from ops.host.transport import (
    SYSROOT_BIN_DIRS,
    CommandTimeout,
    LockTimeout,
    Result,
    Transport,
    env_via_stdin,
)

DEFAULT_KNOWN_HOSTS = "~/.ssh/known_hosts"
# A constant script: put $1 in front of PATH, then exec the rest of the argv.
_PATH_PREFIX_SCRIPT = 'PATH="$1:$PATH"; export PATH; shift; exec "$@"'
# A constant script: take flock(1) on $1 (waiting up to $2 s), say so, hold it until stdin ends.
# The lock dies with the connection: sshd ends the session, `cat` sees EOF, flock exits.
_FLOCK_SCRIPT = (
    'mkdir -p "${1%/*}" && exec flock -w "$2" "$1" sh -c "echo locked; exec cat >/dev/null"'
)
_READ_CHUNK = 65536
KEEPALIVE_S = 5.0  # silence on a running command before an SSH keepalive request is sent
LIVENESS_S = 10.0  # how long that request may go unanswered before the connection is lost
SFTP_TIMEOUT_S = 60.0  # one SFTP request (a read or write of up to 32 KiB, a stat, a rename)
_POLL_S = 0.5  # the read loop's longest wait between checks of the connection


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
        keepalive_s: float = KEEPALIVE_S,
        liveness_s: float = LIVENESS_S,
        sftp_timeout_s: float = SFTP_TIMEOUT_S,
    ) -> None:
        bracketed = f"[{host}]" if ":" in host else host  # an IPv6 address
        label = f"ssh://{user}@{bracketed}" + (f":{port}" if port != 22 else "")
        super().__init__(label, sysroot)
        self.host, self.port, self.user = host, port, user
        self.key_filename = key_filename
        self.known_hosts = Path(os.path.expanduser(known_hosts or DEFAULT_KNOWN_HOSTS))
        self.accept_new_host_key = accept_new_host_key
        self.connect_timeout = connect_timeout
        self.keepalive_s, self.liveness_s = keepalive_s, liveness_s
        self.sftp_timeout_s = sftp_timeout_s
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
        connection.set_keepalive(self.keepalive_s)  # idle tunnels: keep NAT/firewall state
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
            live = client.get_transport()
            if live is None or not live.remote_version:  # TCP accepted, no `SSH-2.0-...` line
                raise DdopsError(
                    self.label,
                    f"no SSH greeting within {self.connect_timeout:g}s: port {self.port} "
                    "accepts connections but does not speak SSH",
                ) from exc
            raise DdopsError(self.label, f"SSH handshake failed: {exc}") from exc
        except OSError as exc:
            raise DdopsError(self.label, f"unreachable: {exc.strerror or exc}") from exc

    def connection(self) -> paramiko.Transport:
        """The live SSH connection, for channels of one's own (ops/bench/tunnel.py forwards)."""
        return self._connection()

    def _sftp(self) -> paramiko.SFTPClient:
        connection = self._connection()  # a dropped connection resets the SFTP session too
        if self._sftp_client is None:
            channel = connection.open_session(timeout=self.sftp_timeout_s)
            channel.settimeout(self.sftp_timeout_s)  # each SFTP request's answer
            # invoke_subsystem waits for the server without a timeout: closing the channel
            # ends that wait (as SSHException "Channel closed.")
            watchdog = threading.Timer(self.sftp_timeout_s, channel.close)
            watchdog.start()
            try:
                channel.invoke_subsystem("sftp")
                self._sftp_client = paramiko.SFTPClient(channel)
            finally:
                watchdog.cancel()
        return self._sftp_client

    @contextlib.contextmanager
    def _sftp_call(self, what: str, path: str) -> Iterator[paramiko.SFTPClient]:
        """The SFTP session for one call on `path`; its faults as DdopsErrors naming the path
        (FileNotFoundError passes: callers test for it). After a timeout or a lost connection
        the session is dropped, so the next call starts a fresh one."""
        obj = f"{self.label}: {path}"
        try:
            yield self._sftp()
        except FileNotFoundError:
            raise
        except TimeoutError as exc:
            self._drop_sftp()
            raise DdopsError(obj, f"SFTP {what} timed out after {self.sftp_timeout_s:g}s") from exc
        except (paramiko.SSHException, EOFError, ConnectionError) as exc:
            self._drop_sftp()
            raise DdopsError(obj, f"SFTP {what} failed: SSH connection lost ({exc})") from exc
        except OSError as exc:
            raise DdopsError(obj, f"SFTP {what} failed: {exc.strerror or exc}") from exc

    def _drop_sftp(self) -> None:
        if self._sftp_client is not None:
            with contextlib.suppress(Exception):  # the session is broken already
                self._sftp_client.close()
            self._sftp_client = None

    def close(self) -> None:
        self._drop_sftp()
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
            channel.exec_command(self.remote_command(remote_argv))  # nosec B601 - shlex.join'ed argv
            if stdin:
                channel.sendall(stdin.encode())
            channel.shutdown_write()
            rc, out, err = _collect(channel, timeout, self._watch(channel))
        except _Lost as exc:
            self.close()
            raise DdopsError(self.label, f"SSH connection lost during `{argv[0]}`: {exc}") from exc
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

    @contextlib.contextmanager
    def flock(self, path: str, timeout: float) -> Iterator[None]:
        """flock(1) on the host, held by a remote process for as long as the `with` block."""
        real = self.host_path(path)
        argv = ["sh", "-c", _FLOCK_SCRIPT, "ddops-flock", real, f"{timeout:g}"]
        channel = self._session()
        try:
            channel.exec_command(self.remote_command(argv))  # nosec B601 - shlex.join'ed argv
            said = _collect_line(channel, timeout + self.connect_timeout, self._watch(channel))
            if said != b"locked\n":
                if channel.exit_status_ready() and channel.recv_exit_status() == 1:
                    raise LockTimeout(f"{self.label}: {path}", f"still locked after {timeout:g}s")
                raise DdopsError(
                    f"{self.label}: {path}", f"cannot take the lock (flock said {said!r})"
                )
            yield
        except _Lost as exc:
            self.close()
            raise DdopsError(self.label, f"SSH connection lost holding {path}: {exc}") from exc
        finally:
            with contextlib.suppress(Exception):  # ends `cat`, so flock lets go
                channel.shutdown_write()
                channel.status_event.wait(self.connect_timeout)
            channel.close()

    def _watch(self, channel: paramiko.Channel) -> _Liveness:
        return _Liveness(channel, self.keepalive_s, self.liveness_s)

    # -- files (SFTP) -------------------------------------------------------------------------
    def _read(self, real_path: str) -> bytes:
        with self._sftp_call("read", real_path) as sftp, sftp.open(real_path, "rb") as f:
            return f.read()

    def _write_atomic(self, real_path: str, data: bytes, mode: int) -> None:
        directory = os.path.dirname(real_path)
        tmp = f"{directory}/.ddops-{secrets.token_hex(6)}"
        with self._sftp_call("write", real_path) as sftp:
            _makedirs(sftp, directory)
            try:
                with sftp.open(tmp, "wb") as f:
                    f.chmod(mode)  # before any byte lands, so a secret is never world-readable
                    f.write(data)
                self.run(["sync", "--", tmp]).check(self.label)  # fsync the file (coreutils)
                sftp.posix_rename(tmp, real_path)
            except BaseException:
                with contextlib.suppress(Exception):  # best effort: the session may be gone
                    sftp.remove(tmp)
                raise

    def _stat_mode(self, real_path: str) -> int | None:
        try:
            with self._sftp_call("stat", real_path) as sftp:
                return sftp.stat(real_path).st_mode & 0o7777
        except FileNotFoundError:
            return None


class _Lost(Exception):
    """The connection under a running command closed or stopped answering."""


class _Liveness:
    """Watches the connection under one command: closed is lost at once; after `keepalive_s`
    without data an SSH keepalive request goes out (any answer, even "unsupported", proves
    the peer is there), and no answer within `liveness_s` is lost."""

    def __init__(self, channel: paramiko.Channel, keepalive_s: float, liveness_s: float) -> None:
        self.channel = channel
        self.keepalive_s, self.liveness_s = keepalive_s, liveness_s
        self.last_heard = time.monotonic()
        self._probe: threading.Thread | None = None
        self._probe_sent = 0.0

    def heard(self) -> None:
        self.last_heard = time.monotonic()

    def check(self) -> None:
        """Raise _Lost when the connection is gone; send or judge a keepalive request."""
        connection = self.channel.get_transport()
        if connection is None or not connection.is_active():
            raise _Lost("the connection closed")
        now = time.monotonic()
        if self._probe is not None and not self._probe.is_alive():
            self._probe = None  # answered
            self.last_heard = now
        if self._probe is None and now - self.last_heard >= self.keepalive_s:
            self._probe = threading.Thread(
                target=connection.global_request,
                args=("keepalive@openssh.com",),
                kwargs={"wait": True},  # wait=True asks for an answer
                daemon=True,
            )
            self._probe_sent = now
            self._probe.start()
        elif self._probe is not None and now - self._probe_sent > self.liveness_s:
            raise _Lost(f"no answer to an SSH keepalive for {self.liveness_s:g}s")


def _collect(
    channel: paramiko.Channel, timeout: float | None, liveness: _Liveness
) -> tuple[int, bytes, bytes]:
    """Read stdout and stderr until the remote command exits; TimeoutError past `timeout`,
    _Lost as soon as the connection is gone."""
    deadline = None if timeout is None else time.monotonic() + timeout
    out, err = bytearray(), bytearray()
    while True:
        got = False
        while channel.recv_ready():
            out += channel.recv(_READ_CHUNK)
            got = True
        while channel.recv_stderr_ready():
            err += channel.recv_stderr(_READ_CHUNK)
            got = True
        if got:
            liveness.heard()
        if channel.eof_received and not channel.recv_ready() and not channel.recv_stderr_ready():
            break
        liveness.check()
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            raise TimeoutError
        # the channel signals new data or EOF; wake up anyway to check the connection
        select.select([channel], [], [], min(_POLL_S, remaining or _POLL_S))
    while not channel.status_event.wait(_POLL_S):
        liveness.check()
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError
    if not channel.exit_status_ready() or channel.recv_exit_status() < 0:
        liveness.check()  # the channel closed without an exit status: was it the connection?
    return channel.recv_exit_status(), bytes(out), bytes(err)


def _collect_line(channel: paramiko.Channel, timeout: float, liveness: _Liveness) -> bytes:
    """The first line the remote command prints (b"" when it exits without one)."""
    deadline = time.monotonic() + timeout
    line = bytearray()
    while not line.endswith(b"\n"):
        if channel.recv_ready():
            line += channel.recv(1)
            liveness.heard()
            continue
        if channel.eof_received or time.monotonic() > deadline:
            break
        liveness.check()
        select.select([channel], [], [], _POLL_S)
    if not line.endswith(b"\n"):
        channel.status_event.wait(max(0.0, deadline - time.monotonic()))
    return bytes(line)


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
