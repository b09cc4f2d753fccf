"""PVE 9's devN hot-plug (pve-container 6.0.4) in real LXC: the ct-config remedy adds a missing
devN entry to a running CT through `pct set` and the CT keeps running (its init's start time); on PVE 8
the entry applies at start, so the remedy restarts the CT as before.

python -m pytest -q tests/integration/test_sim_lxc_hotplug.py
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ops.chain import checks
from ops.sim.lxc import subordinate_ids_for_root
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
    assert outcome.detail.endswith(f"{UVM_TOOLS} not attached: restarted")
    assert init_started(pve9) != started and checks.probe_ct_config(c).ok
    assert node_verdicts(probe(pve9))[UVM_TOOLS] == "ok"
