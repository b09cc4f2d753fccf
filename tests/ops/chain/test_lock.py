"""The host lock (ops/chain/lock.py) and the flock primitive under it, locally and over a real sshd.

The finding: over SSH the lock was a bare `mkdir`, so after a crash every later run waited 30
minutes and failed. Now the lock ends with its holder, and a record its owner left is broken
with a warning.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from ops.chain.lock import LOCK_PATH, OWNER_PATH, host_lock, host_lock_owner
from ops.errors import DdopsError
from ops.host.ssh import SSHTransport
from ops.host.transport import LocalTransport, LockTimeout

HOLD_AND_SLEEP = """
import sys, time
from ops.chain.lock import host_lock
from ops.host.transport import LocalTransport
with host_lock(LocalTransport(sysroot=sys.argv[1])):
    print("held", flush=True)
    time.sleep(600)
"""


def test_a_holder_killed_holding_the_lock_leaves_no_wait_and_is_named(tmp_path, caplog):
    t = LocalTransport(sysroot=str(tmp_path))
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_AND_SLEEP, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout.readline() == "held\n"
    owner = host_lock_owner(t)
    assert (owner.pid, owner.host) == (holder.pid, socket.gethostname())
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, "ops.chain.lock"), host_lock(t, timeout=5):
        assert time.monotonic() - started < 1
        assert host_lock_owner(t).pid == os.getpid()
    assert f"broke the stale lock {LOCK_PATH} of ddops pid {holder.pid} on" in caplog.text
    assert host_lock_owner(t) is None  # released cleanly: nothing to break next time


def test_a_waiter_that_gives_up_names_the_holder(tmp_path):
    t = LocalTransport(sysroot=str(tmp_path))
    with host_lock(t), pytest.raises(DdopsError) as caught, host_lock(t, timeout=0.5):
        pass
    message = str(caught.value)
    assert f"ddops pid {os.getpid()} on {socket.gethostname()} (since " in message
    assert message.endswith(f"holds {LOCK_PATH}; gave up after 0.5s")


def test_an_owner_record_that_is_not_json_is_ignored(tmp_path):
    t = LocalTransport(sysroot=str(tmp_path))
    t.write_file(OWNER_PATH, "garbage", backup=False)
    with host_lock(t, timeout=1):
        assert json.loads(t.read_text(OWNER_PATH))["pid"] == os.getpid()


# -- over SSH: the lock is a remote flock(1) tied to the connection ------------------------------
def ssh_to(server, tmp_path, port: int | None = None) -> SSHTransport:
    port = port or server.port
    known = tmp_path / f"known_hosts_{port}"
    known.write_text(f"[127.0.0.1]:{port} {server.host_public_key}\n")
    return SSHTransport(
        "127.0.0.1",
        port=port,
        user=server.user,
        key_filename=str(server.client_key),
        known_hosts=str(known),
        sysroot=str(tmp_path / "host"),
    )


@pytest.mark.ssh
def test_over_ssh_a_second_holder_waits_then_gets_it(sshd_server, tmp_path, monkeypatch):
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    first, second = ssh_to(sshd_server, tmp_path), ssh_to(sshd_server, tmp_path)
    entered = threading.Event()

    def wait_for_it() -> None:
        with host_lock(second, timeout=10):
            entered.set()

    with host_lock(first, timeout=5):
        waiter = threading.Thread(target=wait_for_it)
        waiter.start()
        assert not entered.wait(1.0)
        assert host_lock_owner(second).pid == os.getpid()
    assert entered.wait(5)
    waiter.join()
    with (
        pytest.raises(LockTimeout, match="still locked after 0.5s"),
        first.flock("/run/lock/x.lock", 5),
        second.flock("/run/lock/x.lock", 0.5),
    ):
        pass
    first.close()
    second.close()


SSH_HOLD_AND_SLEEP = """
import sys, time
from ops.chain.lock import host_lock
from ops.host.ssh import SSHTransport
port, user, key, known, sysroot = sys.argv[1:]
t = SSHTransport("127.0.0.1", port=int(port), user=user, key_filename=key, known_hosts=known,
                 sysroot=sysroot)
with host_lock(t):
    print("held", flush=True)
    time.sleep(600)
"""


@pytest.mark.ssh
def test_over_ssh_a_killed_holder_leaves_no_wait(sshd_server, tmp_path, monkeypatch, caplog):
    """The holder is killed (or its laptop loses the network): the remote flock ends with its
    connection, and the next run takes the lock at once, saying whose lock it broke."""
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    survivor = ssh_to(sshd_server, tmp_path)
    args = [str(sshd_server.port), sshd_server.user, str(sshd_server.client_key)]
    args += [str(tmp_path / f"known_hosts_{sshd_server.port}"), str(tmp_path / "host")]
    holder = subprocess.Popen(
        [sys.executable, "-c", SSH_HOLD_AND_SLEEP, *args], stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout.readline() == "held\n"
    assert host_lock_owner(survivor).pid == holder.pid
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, "ops.chain.lock"), host_lock(survivor, timeout=20):
        assert time.monotonic() - started < 5
    assert f"of ddops pid {holder.pid} on" in caplog.text
    survivor.close()
