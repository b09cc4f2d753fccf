"""PVE 9's devN hot-plug (pve-container 6.0.4) in real LXC: the ct-config remedy adds a missing
devN entry to a running CT through `pct set` and the CT keeps running (its init's start time); on PVE 8
the entry applies at start, so the remedy restarts the CT as before. The live grant is this
machine's (cgroup v1 devices.allow, or on cgroup v2 LXC's replacement of the CT's device program):
where it takes effect the node opens in the CT with no restart; where it cannot (an unprivileged
CT, a grant LXC refuses), the remedy quotes pct's "unable to hotplug" and restarts the CT.

python -m pytest -q tests/integration/test_sim_lxc_hotplug.py
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ops.chain import checks
from ops.sim.lxc import devices_cgroup_is_v1, subordinate_ids_for_root
from ops.site.inventory import ContainerSpec, EngineSpec, ModelRef, ModelSpec
from tests.helpers.simhost import PVE8, node_verdicts, probe, sim_host, start_ct

pytestmark = pytest.mark.lxc

PVE9 = "9.2.11"
UVM_TOOLS = "/dev/nvidia-uvm-tools"


def context(t) -> checks.ChainContext:
    return checks.ChainContext(
        t=t,
        ct=ContainerSpec(200, shm_gib=1, device_style="devN"),
        model=ModelSpec(ModelRef("ddops/tiny-target")),
        engine=EngineSpec(),
    )


def init_started(t) -> str:
    """When the CT's init started (/proc/1/stat's starttime): a restart changes it."""
    stat = t.run(["pct", "exec", "200", "--", "cat", "/proc/1/stat"]).check("CT 200").stdout
    return stat.rsplit(")", 1)[1].split()[19]


def running_without_uvm_tools(t, extra: str = "") -> checks.ChainContext:
    """CT 200 running on the config ddops plans, less its uvm-tools devN entry."""
    c = context(t)
    t.write_file("/etc/pve/lxc/200.conf", "arch: amd64\nhostname: llm\n" + extra, backup=False)
    planned = checks._planned_config(c).planned
    kept = [line for line in planned.splitlines(keepends=True) if UVM_TOOLS not in line]
    start_ct(t, "".join(kept))
    assert node_verdicts(probe(t))[UVM_TOOLS] == "missing"
    return c


@pytest.fixture(params=[PVE9, PVE8])
def host(request, tmp_path: Path):
    yield from sim_host(tmp_path, request.param)


@pytest.fixture
def pve9(tmp_path: Path):
    yield from sim_host(tmp_path, PVE9)


def test_a_new_dev_entry_is_hot_plugged_on_pve_9_and_restarts_the_ct_on_pve_8(host):
    c = running_without_uvm_tools(host)
    assert not checks.probe_ct_config(c).ok
    started = init_started(host)
    outcome = checks.write_ct_config(c, dry_run=False)
    assert checks.probe_ct_config(c).ok
    assert host.run(["pct", "status", "200"]).stdout == "status: running\n"
    if host.run(["pveversion"]).stdout.startswith(f"pve-manager/{PVE9}"):
        assert outcome.detail.endswith("with pct set, hot-plugged: not restarted")
        assert init_started(host) == started
    else:
        assert outcome.detail.endswith("; restarted")
        assert init_started(host) != started
    assert node_verdicts(probe(host))[UVM_TOOLS] == "ok"  # granted and present: it opens


@pytest.mark.skipif(not subordinate_ids_for_root(), reason="root has no subordinate ids")
def test_a_node_pct_set_could_not_attach_restarts_the_ct(pve9):
    c = running_without_uvm_tools(pve9, "unprivileged: 1\n")  # the sim attaches at start only
    started = init_started(pve9)
    outcome = checks.write_ct_config(c, dry_run=False)
    assert outcome.detail.endswith(
        f"{UVM_TOOLS} not attached (pct: unable to hotplug dev3: unprivileged CT: its node is "
        "bound at start): restarted"
    )
    assert init_started(pve9) != started and checks.probe_ct_config(c).ok
    assert node_verdicts(probe(pve9))[UVM_TOOLS] == "ok"


def test_the_live_grant_takes_effect_without_a_restart_on_this_machines_cgroups(pve9):
    """The grant itself, not only the node: a node made in the CT but not granted in its devices
    cgroup (v1 or v2, whichever this machine has) would not open."""
    c = running_without_uvm_tools(pve9)
    started = init_started(pve9)
    outcome = checks.write_ct_config(c, dry_run=False)
    cgroup = "v1" if devices_cgroup_is_v1() else "v2"
    assert outcome.detail.endswith("hot-plugged: not restarted"), (cgroup, outcome.detail)
    assert init_started(pve9) == started
    assert node_verdicts(probe(pve9))[UVM_TOOLS] == "ok"  # opened: granted live


def test_a_live_grant_lxc_refuses_is_named_and_the_ct_restarted(pve9, tmp_path, monkeypatch):
    """Where this machine's LXC cannot change a running CT's device grants (`lxc-cgroup`
    refuses), pct set warns and the entry applies at the next start: the remedy says so, in
    pct's words, and restarts the CT, which then has the node."""
    c = running_without_uvm_tools(pve9)
    refusing = tmp_path / "bin"
    refusing.mkdir()
    (refusing / "lxc-cgroup").write_text(
        "#!/bin/sh\necho 'Failed to set \"devices.allow\"' >&2\nexit 1\n"
    )
    (refusing / "lxc-cgroup").chmod(0o755)
    monkeypatch.setenv("PATH", f"{refusing}:{os.environ['PATH']}")
    started = init_started(pve9)
    outcome = checks.write_ct_config(c, dry_run=False)
    cgroup = "v1" if devices_cgroup_is_v1() else "v2"
    assert f"(pct: unable to hotplug dev3: cgroup {cgroup} live grant `c " in outcome.detail
    assert outcome.detail.endswith('refused (Failed to set "devices.allow")): restarted')
    assert init_started(pve9) != started and checks.probe_ct_config(c).ok
    assert node_verdicts(probe(pve9))[UVM_TOOLS] == "ok"
