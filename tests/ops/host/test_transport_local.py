"""LocalTransport: commands as argv, atomic writes with backups, sysroot path mapping."""

from __future__ import annotations

import os

import pytest

from ops.errors import DdopsError
from ops.host.transport import CommandTimeout, LocalTransport, validate_host_path


def test_run_returns_rc_and_output_without_a_shell(tmp_path):
    t = LocalTransport()
    r = t.run(["sh", "-c", "echo out; echo err >&2; exit 3"])
    assert (r.rc, r.stdout, r.stderr) == (3, "out\n", "err\n")
    # an argument with shell syntax is passed verbatim, never interpreted
    r = t.run(["echo", "$(id); rm -rf /"])
    assert r.stdout == "$(id); rm -rf /\n"
    with pytest.raises(DdopsError, match=r"`sh -c 'exit 4'` exited 4"):
        t.run(["sh", "-c", "exit 4"]).check("CT 200")


def test_missing_command_and_timeout():
    t = LocalTransport()
    assert t.run(["definitely-not-a-command-xyz"]).rc == 127
    with pytest.raises(CommandTimeout, match="timed out after 0.2s"):
        t.run(["sleep", "5"], timeout=0.2)


def test_env_is_passed_not_on_the_command_line():
    r = LocalTransport().run(["sh", "-c", 'printf %s "$SECRET_X"'], env={"SECRET_X": "s3cr3t"})
    assert r.stdout == "s3cr3t"
    assert "s3cr3t" not in " ".join(r.argv)


def test_atomic_write_keeps_a_backup_and_mode(tmp_path):
    t = LocalTransport(sysroot=str(tmp_path))
    assert t.write_file("/etc/pve/lxc/200.conf", "a: 1\n", mode=0o640) is None
    real = tmp_path / "etc/pve/lxc/200.conf"
    assert real.read_text() == "a: 1\n"
    backup = t.write_file("/etc/pve/lxc/200.conf", b"a: 2\n")
    assert backup is not None and backup.startswith(
        "/var/lib/ddops/backups/etc__pve__lxc__200.conf."
    )
    assert t.read_text(backup) == "a: 1\n"
    assert real.read_text() == "a: 2\n"
    assert os.stat(real).st_mode & 0o777 == 0o640
    assert [p.name for p in real.parent.iterdir()] == ["200.conf"]  # no temp files left


def test_sysroot_maps_paths_and_path(tmp_path):
    (tmp_path / "usr/sbin").mkdir(parents=True)
    tool = tmp_path / "usr/sbin/pct"
    tool.write_text('#!/bin/sh\necho simulated pct "$@"\n')
    tool.chmod(0o755)
    t = LocalTransport(sysroot=str(tmp_path))
    assert t.run(["pct", "status", "200"]).stdout == "simulated pct status 200\n"
    assert t.host_path("/proc/devices") == f"{tmp_path}/proc/devices"
    assert not t.exists("/proc/devices")
    with pytest.raises(FileNotFoundError):
        t.read_file("/proc/devices")


@pytest.mark.parametrize("bad", ["relative/path", "/etc/../shadow", "/a\x00b"])
def test_host_paths_are_validated(bad):
    with pytest.raises(DdopsError):
        validate_host_path(bad)
