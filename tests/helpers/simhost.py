"""A simulated Proxmox host for tests: fixtures and the CUDA probe, run through the transport seam.

`sim_host` (for a fixture) yields a `LocalTransport` onto a fresh sim host with real LXC containers and
destroys the host (stopping its containers) afterwards.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from ops.host.transport import LocalTransport
from ops.sim.host import destroy_host, init_host

PROBE = Path(__file__).resolve().parents[2] / "ops" / "agents" / "probe.py"
# As ddops writes raw rules: marked as its own, so a rule left behind by a moved major is replaced.
RAW_GPU_CONF = """\
#ddops owns devices.allow majors 195 {uvm}
arch: amd64
hostname: llm
memory: 8192
onboot: 1
lxc.cgroup2.devices.allow: c 195:* rwm
lxc.cgroup2.devices.allow: c {uvm}:* rwm
lxc.mount.entry: /dev/nvidia0 dev/nvidia0 none bind,optional,create=file
lxc.mount.entry: /dev/nvidiactl dev/nvidiactl none bind,optional,create=file
lxc.mount.entry: /dev/nvidia-uvm dev/nvidia-uvm none bind,optional,create=file
lxc.mount.entry: /dev/nvidia-uvm-tools dev/nvidia-uvm-tools none bind,optional,create=file
"""
DEV_GPU_CONF = """\
arch: amd64
hostname: llm
onboot: 1
dev0: /dev/nvidia0,gid=44
dev1: /dev/nvidiactl,gid=44
dev2: /dev/nvidia-uvm,gid=44
dev3: /dev/nvidia-uvm-tools,gid=44
"""


PVE8 = "8.2.4"  # the tests written against PVE 8 (its 550.90.07 driver, 6.8 kernel) keep it


def sim_host(tmp_path: Path, pve_version: str = PVE8) -> Iterator[LocalTransport]:
    """For a fixture: `yield from sim_host(tmp_path)`."""
    root = tmp_path / "pve"
    init_host(root, gpus=1, uvm_major=511, containers="lxc", pve_version=pve_version)
    yield LocalTransport(sysroot=str(root))
    destroy_host(root)


def start_ct(t: LocalTransport, conf: str, vmid: int = 200) -> None:
    t.write_file(f"/etc/pve/lxc/{vmid}.conf", conf, backup=False)
    t.run(["pct", "start", str(vmid)]).check(f"CT {vmid}")
    push_probe(t, vmid)


def push_probe(t: LocalTransport, vmid: int = 200) -> None:
    """The probe lands in the CT's own /tmp (its rootfs): it stays there across restarts."""
    t.write_file("/tmp/ddops-probe.py", PROBE.read_bytes(), backup=False)
    t.run(["pct", "push", str(vmid), "/tmp/ddops-probe.py", "/tmp/ddops-probe.py"]).check("push")


def probe(t: LocalTransport, vmid: int = 200) -> dict:
    r = t.run(["pct", "exec", str(vmid), "--", "python3", "/tmp/ddops-probe.py", "--json"])
    report = json.loads(r.stdout)
    assert r.rc == (0 if report["verdict"] == "ok" else 1)
    return report


def node_verdicts(report: dict) -> dict[str, str]:
    return {n["node"]: n["verdict"] for n in report["nodes"]}
