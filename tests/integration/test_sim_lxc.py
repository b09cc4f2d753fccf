"""The incident, reproduced in real LXC containers on a simulated Proxmox host (marker `lxc`).

    python -m pytest -q tests/integration/test_sim_lxc.py

Every check goes through the transport seam (`LocalTransport(sysroot=...)`) as ddops does:
`pct`, `nvidia-modprobe` and the CUDA probe run exactly as they would on a real host.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ops.host import gpu, pve
from ops.sim import faults
from ops.sim.host import reboot_host
from tests.helpers.simhost import RAW_GPU_CONF, node_verdicts, probe, sim_host, start_ct

pytestmark = pytest.mark.lxc


@pytest.fixture
def host(tmp_path: Path):
    yield from sim_host(tmp_path)


def test_reboot_with_new_uvm_major_reproduces_the_incident_until_the_grant_is_fixed(host):
    start_ct(host, RAW_GPU_CONF.format(uvm=511))
    assert probe(host)["verdict"] == "ok"
    host.run(["pct", "exec", "200", "--", "sh", "-c", "echo weights > /dev/shm/model"]).check("shm")

    host.write_file("/etc/modules-load.d/nvidia.conf", "nvidia\nnvidia_uvm\n", backup=False)

    report = reboot_host(Path(host.sysroot), uvm_major=509)

    assert report.started == [200]
    facts = gpu.gpu_facts(host)  # what ddops reads: the module is back, with a new major...
    assert (facts.majors.nvidia, facts.majors.uvm) == (195, 509)
    assert facts.node("/dev/nvidia-uvm") is None  # ...but its node is not
    assert facts.node("/dev/nvidia0").major == 195
    grants = pve.ct_config(host, 200).all("lxc.cgroup2.devices.allow")
    assert grants == ["c 195:* rwm", "c 511:* rwm"]  # the stale rule
    shm = host.run(["pct", "exec", "200", "--", "ls", "/dev/shm"])
    assert shm.ok and "model" not in shm.stdout  # a real tmpfs, emptied by the stop
    assert node_verdicts(probe(host))["/dev/nvidia-uvm"] == "missing"  # `optional` hid it

    gpu.create_uvm_nodes(host)
    assert gpu.gpu_facts(host).node("/dev/nvidia-uvm").major == 509
    host.run(["pct", "reboot", "200"]).check("CT 200")
    blocked = probe(host)
    assert node_verdicts(blocked)["/dev/nvidia-uvm"] == "blocked"
    assert blocked["reason"] == "/dev/nvidia-uvm: blocked by the device cgroup (EPERM)"
    smi = host.run(["pct", "exec", "200", "--", "nvidia-smi", "-L"])
    assert smi.ok and smi.stdout.startswith("GPU 0: NVIDIA")  # nvidia-smi still lists the GPU

    host.write_file("/etc/pve/lxc/200.conf", RAW_GPU_CONF.format(uvm=509), backup=False)
    assert node_verdicts(probe(host))["/dev/nvidia-uvm"] == "blocked"  # not before a restart
    host.run(["pct", "reboot", "200"]).check("CT 200")
    fixed = probe(host)
    assert fixed["verdict"] == "ok" and fixed["cuda"]["cuInit"] == 0
    log = host.read_text("/var/log/ddops-sim.log")
    assert "applied as lxc.cgroup.devices.*" in log


def test_an_explicit_shm_size_is_honoured_and_faults_act_inside_the_ct(host):
    shm_line = "lxc.mount.entry: tmpfs dev/shm tmpfs rw,nosuid,nodev,size=64m,create=dir 0 0\n"
    start_ct(host, RAW_GPU_CONF.format(uvm=511) + shm_line)
    df = host.run(["pct", "exec", "200", "--", "df", "-k", "/dev/shm"]).stdout.splitlines()
    assert df[1].split()[1] == "65536"  # 64 MiB in 1K blocks
    host.write_file("/tmp/model", b"x" * 1000, backup=False)
    host.run(["pct", "push", "200", "/tmp/model", "/dev/shm/model"]).check("push")
    root = Path(host.sysroot)
    faults.truncate_ct_file(root, 200, "/dev/shm/model", 10)
    assert (
        host.run(["pct", "exec", "200", "--", "wc", "-c", "/dev/shm/model"]).stdout.split()[0]
        == "10"
    )
    spawn = ["sh", "-c", "sleep 600 >/dev/null 2>&1 & echo $!"]
    pid = int(host.run(["pct", "exec", "200", "--", *spawn]).stdout)
    assert host.run(["pct", "exec", "200", "--", "kill", "-0", str(pid)]).ok
    faults.kill_ct_process(root, 200, pid)
    stat = host.run(["pct", "exec", "200", "--", "cat", f"/proc/{pid}/stat"])
    assert not stat.ok or stat.stdout.split()[2] == "Z"  # gone, or dead and not yet reaped
