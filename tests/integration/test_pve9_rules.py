"""PVE 9's rules, read from the host: cgroup v1 keys are a problem there, ddops never writes one.

python -m pytest -q tests/integration/test_pve9_rules.py
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ops.chain import checks
from ops.host.lxcconf import GpuBlock, GpuDevice, plan_gpu_block
from ops.host.transport import LocalTransport
from ops.sim.host import destroy_host, init_host
from ops.site.inventory import ContainerSpec, EngineSpec, ModelRef, ModelSpec
from tests.helpers.simhost import PVE8

CONF = "arch: amd64\nhostname: llm\nlxc.cgroup.cpu.shares: 512\nlxc.cgroup2.cpu.weight: 50\n"


@pytest.mark.parametrize("version", ["9.2.11", PVE8])
def test_a_cgroup_v1_key_is_a_problem_on_pve_9_only(tmp_path: Path, version: str):
    init_host(tmp_path / "pve", containers="process", pve_version=version)
    t = LocalTransport(sysroot=str(tmp_path / "pve"))
    t.write_file("/etc/pve/lxc/200.conf", CONF + "\n[snap]\nlxc.cgroup.cpu.shares: 1\n")
    c = checks.ChainContext(
        t=t,
        ct=ContainerSpec(200),
        model=ModelSpec(ModelRef("ddops/tiny-target")),
        engine=EngineSpec(),
    )
    finding = checks.probe_cgroup_keys(c)
    if version == PVE8:
        assert finding.ok and "ignored on PVE 8.2.4 (cgroup v2)" in finding.evidence
    else:
        assert finding == checks.Finding(
            False,
            "CT 200: line 3: `lxc.cgroup.cpu.shares: 512`: cgroup v1 key(s) on PVE 9.2.11, which "
            "has cgroup v2 only: LXC ignores them and pve-container will refuse them; write "
            "lxc.cgroup2.* instead (or drop them) in /etc/pve/lxc/200.conf",
            fixable=False,
        )
    destroy_host(tmp_path / "pve")


def test_ddops_writes_no_cgroup_v1_key_and_drops_its_own_old_spelling():
    devices = (GpuDevice("/dev/nvidia0", 195, 0), GpuDevice("/dev/nvidia-uvm", 509, 0))
    old = "arch: amd64\nlxc.cgroup.devices.allow: c 195:* rwm\n"
    for style in ("raw", "devN"):
        planned = plan_gpu_block(old, GpuBlock(devices, style=style), {"nvidia-uvm": 509})
        assert not [line for line in planned.splitlines() if line.startswith("lxc.cgroup.")]


@pytest.mark.parametrize(
    "options",
    [{"driver": "550.163.01"}, {"driver": "590.48.01", "open_module": False}],
)
def test_a_blackwell_gpu_on_the_proprietary_module_is_a_failed_check_naming_the_fix(
    tmp_path: Path, options: dict
):
    init_host(tmp_path / "pve", containers="process", **options)
    t = LocalTransport(sysroot=str(tmp_path / "pve"))
    c = checks.ChainContext(
        t=t, ct=ContainerSpec(200), model=ModelSpec(ModelRef("ddops/t")), engine=EngineSpec()
    )
    assert t.run(["nvidia-smi", "-L"]).stdout == "No devices were found\n"
    assert checks.probe_modules(c) == checks.Finding(
        False,
        f"sim:{t.sysroot}: the proprietary nvidia module {options['driver']} is loaded, but RTX "
        "PRO 6000 Blackwell Workstation Edition needs NVIDIA's open kernel module (Blackwell): "
        "install the driver's open flavour (nvidia-open, or the .run installer's "
        "-m=kernel-open; the open module is the default from 560) and reboot",
        fixable=False,
    )
    destroy_host(tmp_path / "pve")
