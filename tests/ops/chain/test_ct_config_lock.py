"""CT config edits under Proxmox's own config lock (flock on /run/lock/lxc/pve-config-<vmid>.lock,
which `pct set` takes), on a simulated host whose pct takes it too.

The finding: ddops read, planned and wrote /etc/pve/lxc/<vmid>.conf without that lock, so an
edit Proxmox made in between was lost (or ddops' own was).
"""

from __future__ import annotations

import fcntl
import threading
import time
from pathlib import Path

import pytest

from ops.chain import checks
from ops.chain.checks import ChainContext
from ops.errors import DdopsError
from ops.host.pve import CONFIG_LOCK, ct_config_lock
from ops.host.transport import LocalTransport
from ops.sim.host import init_host
from ops.site.inventory import ContainerSpec, EngineSpec, ModelRef, ModelSpec

CONF = "arch: amd64\nhostname: llm\nmemory: 2048\n"


@pytest.fixture
def host(tmp_path) -> LocalTransport:
    init_host(tmp_path / "pve", gpus=1, containers="process")
    t = LocalTransport(sysroot=str(tmp_path / "pve"))
    t.write_file("/etc/pve/lxc/200.conf", CONF, backup=False)
    return t


def lock_file(t: LocalTransport) -> Path:
    path = Path(t.host_path(CONFIG_LOCK.format(vmid=200)))
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def test_the_sims_pct_set_waits_for_the_config_lock(host):
    done = threading.Event()
    result = {}

    def pct_set() -> None:
        result["r"] = host.run(["pct", "set", "200", "--memory", "4096"])
        done.set()

    with ct_config_lock(host, 200):
        threading.Thread(target=pct_set).start()
        assert not done.wait(1.0)  # pct set waits, as Proxmox's lock_config does
    assert done.wait(10) and result["r"].ok
    assert "memory: 4096\n" in host.read_text("/etc/pve/lxc/200.conf")


def test_the_sims_pct_set_gives_proxmoxs_error_after_10s(host, monkeypatch):
    from ops.sim import pct

    monkeypatch.setattr(pct, "CONFIG_LOCK_TIMEOUT_S", 0.3)
    with lock_file(host).open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        code = pct.main(Path(host.sysroot), ["set", "200", "--memory", "4096"])
    assert code == pct.TASK_ERROR


def test_a_config_lock_held_too_long_is_one_clear_error(host):
    with lock_file(host).open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        with pytest.raises(DdopsError) as caught, ct_config_lock(host, 200, timeout=0.3):
            pass
    assert str(caught.value) == (
        "CT 200: its config is being changed by another task "
        "(/run/lock/lxc/pve-config-200.lock still locked after 0.3s)"
    )


def test_an_edit_made_by_proxmox_meanwhile_is_not_lost(host):
    """A `pct set` that read the config holds the lock while it writes; ddops' GPU block edit
    waits for it and then plans on the config as Proxmox left it: both changes stay."""
    c = ChainContext(
        t=host,
        ct=ContainerSpec(200, shm_gib=1, device_style="raw"),
        model=ModelSpec(ModelRef("ddops/tiny-target", name="target")),
        engine=EngineSpec(dtype="float32", device="cpu", python="/usr/bin/python3"),
    )
    path = Path(host.host_path("/etc/pve/lxc/200.conf"))
    pct_set_holds = threading.Event()

    def proxmox_pct_set() -> None:  # what PVE does: lock, read, change, write, unlock
        with lock_file(host).open("a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            text = path.read_text()
            pct_set_holds.set()
            time.sleep(1.0)  # ddops tries its edit now
            path.write_text(text.replace("memory: 2048", "memory: 4096"))

    proxmox = threading.Thread(target=proxmox_pct_set)
    proxmox.start()
    assert pct_set_holds.wait(10)
    outcome = checks.write_ct_config(c, dry_run=False)
    proxmox.join()
    final = path.read_text()
    assert "memory: 4096\n" in final  # Proxmox's change
    assert "lxc.cgroup2.devices.allow: c 195:* rwm\n" in final  # and ddops'
    assert outcome.detail.startswith("wrote /etc/pve/lxc/200.conf")
