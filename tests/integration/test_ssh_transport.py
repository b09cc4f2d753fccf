"""SSHTransport against a real sshd on 127.0.0.1 (tests/helpers/sshd.py).

Run: python -m pytest -q tests/integration/test_ssh_transport.py
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time

import pytest
from click.testing import CliRunner

from ops.cli import cli
from ops.errors import DdopsError
from ops.host.ssh import SSHTransport
from ops.host.transport import CommandTimeout
from tests.helpers.sshd import SshServer, free_port, keygen, running_ssh_agent
from tests.helpers.tcpproxy import TcpProxy, silent_listener

pytestmark = pytest.mark.ssh


def connect(server: SshServer, tmp_path, **kwargs) -> SSHTransport:
    kwargs.setdefault("known_hosts", str(server.write_known_hosts(tmp_path / "known_hosts")))
    kwargs.setdefault("key_filename", str(server.client_key))
    return SSHTransport(server.host, port=server.port, user=server.user, **kwargs)


@pytest.fixture
def ssh(sshd_server, tmp_path, monkeypatch):
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)  # only the test's key may log in
    t = connect(sshd_server, tmp_path)
    yield t
    t.close()


def fingerprint(public_key: str, tmp_path) -> str:
    """The SHA256 fingerprint as OpenSSH's own ssh-keygen prints it."""
    pub = tmp_path / "key.pub"
    pub.write_text(public_key + "\n")
    return subprocess.run(
        ["ssh-keygen", "-lf", str(pub)], capture_output=True, text=True, check=True
    ).stdout.split()[1]


def test_commands_give_exit_code_streams_and_stdin(ssh):
    r = ssh.run(["sh", "-c", "echo out; echo err >&2; exit 3"])
    assert (r.rc, r.stdout, r.stderr) == (3, "out\n", "err\n")
    assert ssh.run(["tr", "a-z", "A-Z"], input="piped\n").stdout == "PIPED\n"
    assert ssh.run(["definitely-not-a-command-xyz"]).rc == 127
    with pytest.raises(DdopsError, match=r"`sh -c 'exit 4'` exited 4"):
        ssh.run(["sh", "-c", "exit 4"]).check("CT 200")


def test_hostile_arguments_arrive_verbatim(ssh):
    hostile = [
        "$(id)",
        "a b",
        "'single'",
        '"double"',
        "x;reboot",
        "`tick`",
        "new\nline",
        "*",
        "~",
        "",
    ]
    r = ssh.run(["printf", "[%s]", *hostile])
    assert r.stdout == "".join(f"[{a}]" for a in hostile)


def test_env_travels_on_stdin_never_on_any_command_line(ssh):
    secret = "hf_s3cr3t-VALUE with spaces"
    # Print the secret as the command sees it, then the command line of the command and of
    # every ancestor process on the remote side (login shell, sshd session).
    script = (
        'printf "%s\\n" "$HF_TOKEN"; cat; echo; pid=$$; while [ "$pid" -gt 1 ]; do '
        "tr '\\0' ' ' < /proc/$pid/cmdline; echo; "
        "pid=$(awk '/^PPid:/ {print $2}' /proc/$pid/status); done"
    )
    r = ssh.run(["sh", "-c", script], env={"HF_TOKEN": secret}, input="stdin after env")
    first, stdin_seen, *command_lines = r.stdout.splitlines()
    assert (first, stdin_seen) == (secret, "stdin after env")
    assert any("sshd" in line for line in command_lines)  # the walk reached the session
    assert not [line for line in command_lines if "s3cr3t" in line]
    with pytest.raises(DdopsError, match="one line"):
        ssh.run(["true"], env={"BAD": "two\nlines"})


def test_atomic_write_with_backup_and_sysroot(sshd_server, tmp_path, monkeypatch):
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    root = tmp_path / "host"
    (root / "usr/sbin").mkdir(parents=True)
    (root / "usr/sbin/pct").write_text('#!/bin/sh\necho simulated pct "$@"\n')
    (root / "usr/sbin/pct").chmod(0o755)
    t = connect(sshd_server, tmp_path, sysroot=str(root))
    try:
        assert t.run(["pct", "status", "200"]).stdout == "simulated pct status 200\n"
        assert t.write_file("/etc/pve/lxc/200.conf", "a: 1\n", mode=0o640) is None
        real = root / "etc/pve/lxc/200.conf"
        backup = t.write_file("/etc/pve/lxc/200.conf", "a: 2\n")
        assert backup.startswith("/var/lib/ddops/backups/etc__pve__lxc__200.conf.")
        assert t.read_text(backup) == "a: 1\n"
        assert (real.read_text(), os.stat(real).st_mode & 0o777) == ("a: 2\n", 0o640)
        assert [p.name for p in real.parent.iterdir()] == ["200.conf"]  # no temp files left
        assert t.exists("/etc/pve/lxc/200.conf") and not t.exists("/etc/pve/lxc/201.conf")
        with pytest.raises(FileNotFoundError):
            t.read_file("/etc/pve/lxc/201.conf")
    finally:
        t.close()


def test_unknown_host_key_is_refused_unless_accepted_then_recorded(sshd_server, tmp_path):
    known_hosts = tmp_path / "fresh_known_hosts"
    key = str(sshd_server.client_key)
    t = connect(sshd_server, tmp_path, known_hosts=str(known_hosts), key_filename=key)
    expected = fingerprint(sshd_server.host_public_key, tmp_path)
    with pytest.raises(DdopsError, match="unknown host key") as refused:
        t.run(["true"])
    assert expected in str(refused.value) and sshd_server.target in str(refused.value)
    assert not known_hosts.exists()

    accepting = connect(
        sshd_server, tmp_path, known_hosts=str(known_hosts), accept_new_host_key=True
    )
    assert accepting.run(["true"]).rc == 0
    accepting.close()
    assert known_hosts.read_text() == sshd_server.known_hosts_line
    assert os.stat(known_hosts).st_mode & 0o777 == 0o600
    assert t.run(["true"]).rc == 0  # recorded: now trusted without the flag
    t.close()


def test_changed_host_key_is_refused_even_when_accepting_new(sshd_server, tmp_path):
    other = keygen(tmp_path / "impostor").with_suffix(".pub").read_text().split()[:2]
    known_hosts = tmp_path / "stale_known_hosts"
    known_hosts.write_text(f"[{sshd_server.host}]:{sshd_server.port} {' '.join(other)}\n")
    t = connect(sshd_server, tmp_path, known_hosts=str(known_hosts), accept_new_host_key=True)
    with pytest.raises(DdopsError, match="host key CHANGED") as refused:
        t.run(["true"])
    assert fingerprint(sshd_server.host_public_key, tmp_path) in str(refused.value)
    assert len(known_hosts.read_text().splitlines()) == 1  # nothing recorded


def test_wrong_client_key_is_a_clear_auth_error(sshd_server, tmp_path, monkeypatch):
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    stranger = keygen(tmp_path / "stranger")
    t = connect(sshd_server, tmp_path, key_filename=str(stranger))
    with pytest.raises(DdopsError, match=f"authentication failed for user {sshd_server.user}"):
        t.run(["true"])


def test_ssh_agent_keys_log_in_without_a_key_file(sshd_server, tmp_path, monkeypatch):
    with running_ssh_agent(tmp_path, sshd_server.client_key) as agent_socket:
        monkeypatch.setenv("SSH_AUTH_SOCK", agent_socket)
        t = connect(sshd_server, tmp_path, key_filename=None)  # HOME has no keys: agent only
        assert t.run(["echo", "via agent"]).stdout == "via agent\n"
        t.close()


def test_unresolvable_host_is_a_clear_unreachable_error(tmp_path, monkeypatch):
    def no_dns(*args, **kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", no_dns)  # no DNS server needed for this test
    t = SSHTransport("pve9.example.invalid", known_hosts=str(tmp_path / "kh"))
    with pytest.raises(DdopsError, match="unreachable: cannot resolve 'pve9.example.invalid'"):
        t.run(["true"])


def test_closed_port_is_a_clear_unreachable_error(tmp_path):
    port = free_port()  # nothing listens there
    t = SSHTransport("127.0.0.1", port=port, known_hosts=str(tmp_path / "kh"))
    with pytest.raises(DdopsError, match=f"unreachable: connection refused on port {port}") as e:
        t.run(["true"])
    assert f"127.0.0.1:{port}" in str(e.value)


def test_command_timeout_then_the_connection_still_works(ssh):
    with pytest.raises(CommandTimeout, match=r"`sleep 5` timed out after 0.3s"):
        ssh.run(["sleep", "5"], timeout=0.3)
    assert ssh.run(["echo", "still here"]).stdout == "still here\n"


def test_one_connection_serves_every_call_until_closed(ssh):
    def client_endpoint() -> str:  # "client_ip client_port server_ip server_port"
        return ssh.run(["sh", "-c", 'echo "$SSH_CONNECTION"']).stdout

    first = client_endpoint()
    assert ssh.exists("/")  # SFTP rides the same connection
    assert client_endpoint() == first
    ssh.close()
    assert client_endpoint() != first  # a fresh connection after close()


# -- faults: a connection that drops or goes silent, SFTP failures, a peer that is not SSH -------


def through(proxy: TcpProxy, server: SshServer, tmp_path, **kwargs) -> SSHTransport:
    known = tmp_path / "known_hosts_proxy"
    known.write_text(f"[127.0.0.1]:{proxy.port} {server.host_public_key}\n")
    return SSHTransport(
        "127.0.0.1",
        port=proxy.port,
        user=server.user,
        key_filename=str(server.client_key),
        known_hosts=str(known),
        **kwargs,
    )


def run_and_time(t: SSHTransport, argv: list[str], **kwargs) -> tuple[BaseException | None, float]:
    started = time.monotonic()
    try:
        t.run(argv, **kwargs)
    except DdopsError as exc:
        return exc, time.monotonic() - started
    return None, time.monotonic() - started


def test_a_connection_cut_mid_command_is_lost_within_seconds(sshd_server, tmp_path, monkeypatch):
    """The finding: a drop was reported only as a timeout after the command's whole timeout."""
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    with TcpProxy((sshd_server.host, sshd_server.port)) as proxy:
        t = through(proxy, sshd_server, tmp_path)
        assert t.run(["true"]).ok
        threading.Timer(1.0, proxy.cut).start()
        error, seconds = run_and_time(t, ["sleep", "120"], timeout=30)
        assert isinstance(error, DdopsError) and not isinstance(error, CommandTimeout)
        assert "SSH connection lost during `sleep`" in str(error)
        assert seconds < 5
        assert t.run(["echo", "back"]).stdout == "back\n"  # a new connection serves the next call
        t.close()


def test_a_connection_gone_silent_is_lost_after_keepalive_and_grace(
    sshd_server, tmp_path, monkeypatch
):
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    with TcpProxy((sshd_server.host, sshd_server.port)) as proxy:
        t = through(proxy, sshd_server, tmp_path, keepalive_s=1.0, liveness_s=2.0)
        assert t.run(["true"]).ok
        threading.Timer(0.5, proxy.freeze).start()
        error, seconds = run_and_time(t, ["sleep", "120"], timeout=30)
        assert "no answer to an SSH keepalive for 2s" in str(error)
        assert seconds < 8
        t.close()


def test_a_quiet_command_on_a_live_connection_is_not_taken_for_lost(ssh_fast):
    """Keepalive requests are answered (OpenSSH says "unsupported", which proves it is there)."""
    assert ssh_fast.run(["sh", "-c", "sleep 5; echo done"]).stdout == "done\n"


@pytest.fixture
def ssh_fast(sshd_server, tmp_path, monkeypatch):
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    t = connect(sshd_server, tmp_path, keepalive_s=0.5, liveness_s=3.0, sftp_timeout_s=2.0)
    yield t
    t.close()


def test_sftp_failures_are_one_error_naming_the_path(ssh_fast, tmp_path):
    (tmp_path / "adir").mkdir()
    with pytest.raises(DdopsError, match=rf"{tmp_path}/adir: SFTP read failed: ") as caught:
        ssh_fast.read_file(str(tmp_path / "adir"))
    assert caught.value.obj == f"{ssh_fast.label}: {tmp_path}/adir"
    with pytest.raises(FileNotFoundError):  # absent stays FileNotFoundError: callers test for it
        ssh_fast.read_file(str(tmp_path / "absent"))


def test_an_sftp_call_that_gets_no_answer_times_out_naming_the_path(
    sshd_server, tmp_path, monkeypatch
):
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    (tmp_path / "f").write_text("x")
    with TcpProxy((sshd_server.host, sshd_server.port)) as proxy:
        t = through(proxy, sshd_server, tmp_path, sftp_timeout_s=1.0)
        assert t.read_text(str(tmp_path / "f")) == "x"  # the SFTP session is open
        proxy.freeze()
        caught: list[BaseException] = []

        def read() -> None:
            try:
                t.read_file(str(tmp_path / "f"))
            except DdopsError as exc:
                caught.append(exc)

        reader = threading.Thread(target=read, daemon=True)  # it hung for good before
        reader.start()
        reader.join(4)
        assert not reader.is_alive()
        assert str(caught[0]).endswith(f"{tmp_path}/f: SFTP read timed out after 1s")
        t.close()


def test_a_peer_that_never_speaks_ssh_is_one_error_after_the_connect_timeout(tmp_path):
    with silent_listener() as port:
        t = SSHTransport(
            "127.0.0.1", port=port, connect_timeout=1.0, known_hosts=str(tmp_path / "k")
        )
        error, seconds = run_and_time(t, ["true"])
    assert str(error) == (
        f"ssh://root@127.0.0.1:{port}: no SSH greeting within 1s: port {port} accepts "
        "connections but does not speak SSH"
    )
    assert 0.9 < seconds < 4


def test_the_cli_keeps_paramikos_thread_tracebacks_out_of_stderr():
    CliRunner().invoke(cli, ["sim", "--help"])
    assert logging.getLogger("paramiko").level == logging.CRITICAL
    CliRunner().invoke(cli, ["-vv", "sim", "--help"])
    assert logging.getLogger("paramiko").level == logging.DEBUG


@pytest.mark.slow  # the CLI's 10 s connect timeout
def test_the_cli_says_one_line_for_a_silent_peer_no_traceback(tmp_path):
    """paramiko's own thread logged the handshake failure as an ERROR traceback."""
    site = tmp_path / "site.yml"
    with silent_listener() as port:
        site.write_text(
            "all:\n  vars: {ddops_model: {target: {repo: a/b}}}\n  hosts:\n    pve1:\n"
            f"      ddops_target: ssh://root@127.0.0.1:{port}\n"
            "      ddops_containers: [{vmid: 200}]\n"
        )
        proc = subprocess.run(
            [sys.executable, "-m", "ops.cli", "-i", str(site), "health", "--ct", "200"],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "HOME": str(tmp_path)},
        )
    assert "Traceback" not in proc.stderr
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [
        f"Error: ssh://root@127.0.0.1:{port}: no SSH greeting within 10s: port {port} accepts "
        "connections but does not speak SSH"
    ], proc.stderr
