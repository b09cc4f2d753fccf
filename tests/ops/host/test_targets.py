"""Host targets: parsing `local`, `sim:PATH`, `ssh://...`, and the transports they open.

Run: python -m pytest -q tests/ops/host/test_targets.py
"""

from __future__ import annotations

import pytest

from ops.errors import DdopsError, InputError
from ops.host.ssh import SSHTransport
from ops.host.targets import Target, open_transport, parse_target
from ops.host.transport import LocalTransport


@pytest.fixture
def sim_host(tmp_path):
    (tmp_path / "etc/pve").mkdir(parents=True)
    return tmp_path


@pytest.mark.parametrize(
    ("target", "expected"),
    [
        ("ssh://pve1", Target("ssh", host="pve1", port=22, user="root")),
        ("ssh://admin@pve1.example.org:2222", Target("ssh", "pve1.example.org", 2222, "admin")),
        ("ssh://10.0.0.5:22", Target("ssh", host="10.0.0.5")),
        ("ssh://[fd00::5]:2200", Target("ssh", host="fd00::5", port=2200)),
        ("ssh://root@h1/?sysroot=/tmp/pve1", Target("ssh", host="h1", sysroot="/tmp/pve1")),
    ],
)
def test_ssh_targets_parse(target, expected):
    assert parse_target(target) == expected


@pytest.mark.parametrize(
    ("target", "complaint"),
    [
        ("pve1", "accepted forms: local, sim:PATH, ssh://"),
        ("ssh:/pve1", "accepted forms"),
        ("ssh://", "invalid host name"),
        ("ssh://-pve1", "invalid host name"),
        ("ssh://pve_1", "invalid host name"),
        ("ssh://a b", "invalid host name"),
        ("ssh://pve1:0", "port must be 1..65535"),
        ("ssh://pve1:70000", "Port out of range"),
        ("ssh://pve1:ssh", "accepted forms"),
        ("ssh://-oProxyCommand=x@pve1", "invalid user name"),
        ("ssh://root:secret@pve1", "a password in the URL is not accepted"),
        ("ssh://pve1/etc", "only user, host, port"),
        ("ssh://pve1?sysroot=tmp/x", "not an absolute host path"),
        ("ssh://pve1?sysroot=/a&x=1", "only ?sysroot="),
        ("sim:", "needs a path"),
    ],
)
def test_bad_targets_are_refused_clearly(target, complaint):
    with pytest.raises(DdopsError, match=complaint.replace("?", r"\?")):
        parse_target(target)


@pytest.mark.parametrize(
    "target",
    [
        "ssh://root:hunter2@pve1",
        "ssh://root:hunter2@pve1:notaport",
        "ssh://root:hunter2@-pve1",
        "ssh://root:hunter2@pve1/etc",
        "ssh://root:hunter2@pve1\n",
        "ssh://:hunter2@pve1",
    ],
)
def test_a_password_in_a_target_is_never_shown(target):
    with pytest.raises(InputError) as caught:
        parse_target(target)
    assert "hunter2" not in str(caught.value) + caught.value.detail
    assert "***" in str(caught.value) or "password" in str(caught.value)


def test_sim_target_must_look_like_a_simulated_host(sim_host, tmp_path, monkeypatch):
    assert parse_target(f"sim:{sim_host}") == Target("sim", sysroot=str(sim_host))
    monkeypatch.chdir(sim_host.parent)
    assert parse_target(f"sim:{sim_host.name}").sysroot == str(sim_host)  # made absolute
    with pytest.raises(DdopsError, match="no etc/pve"):
        parse_target(f"sim:{tmp_path / 'missing'}")


def test_open_transport_builds_each_kind_without_connecting(sim_host, tmp_path):
    local = open_transport("local")
    assert isinstance(local, LocalTransport) and local.sysroot is None
    sim = open_transport(f"sim:{sim_host}")
    assert isinstance(sim, LocalTransport) and sim.host_path("/etc/pve") == f"{sim_host}/etc/pve"
    ssh = open_transport(
        "ssh://admin@127.0.0.1:2222?sysroot=/srv/pve",
        accept_new_host_key=True,
        known_hosts=str(tmp_path / "kh"),
        key_filename="/keys/id",
    )
    assert isinstance(ssh, SSHTransport)
    assert (ssh.host, ssh.port, ssh.user, ssh.sysroot) == ("127.0.0.1", 2222, "admin", "/srv/pve")
    assert (ssh.accept_new_host_key, ssh.key_filename) == (True, "/keys/id")
    assert ssh.known_hosts == tmp_path / "kh"
    assert ssh.label == "ssh://admin@127.0.0.1:2222"
