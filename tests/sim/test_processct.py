"""The sim's fallback without root or lxc: CTs as plain processes, same files and commands.

    python -m pytest -q tests/sim/test_processct.py

No device cgroup exists in this mode, so it cannot show EPERM; everything else ddops reads
(pct messages, exit codes, /proc/devices, missing nodes, an emptied /dev/shm) behaves as with
real containers.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from ops.host.transport import LocalTransport
from ops.sim.host import destroy_host, init_host, reboot_host
from tests.helpers.simhost import DEV_GPU_CONF, RAW_GPU_CONF, node_verdicts, probe, start_ct


@pytest.fixture
def host(tmp_path: Path):
    root = tmp_path / "pve"
    init_host(root, gpus=2, uvm_major=511, containers="process")
    yield LocalTransport(sysroot=str(root))
    destroy_host(root)


def test_exec_push_pull_stop_and_exit_codes_behave_like_pct(host):
    start_ct(host, RAW_GPU_CONF.format(uvm=511))
    assert host.run(["pct", "exec", "200", "--", "sh", "-c", "exit 7"]).rc == 7
    again = host.run(["pct", "start", "200"])
    assert (again.rc, again.stderr.strip()) == (255, "CT 200 already running")
    missing = host.run(["pct", "status", "999"])
    assert (missing.rc, missing.stderr.strip()) == (
        255,
        "Configuration file 'nodes/pve/lxc/999.conf' does not exist",
    )
    host.run(["pct", "pull", "200", "/tmp/ddops-probe.py", "/root/copy.py"]).check("pull")
    assert host.read_text("/root/copy.py") == host.read_text("/tmp/ddops-probe.py")
    report = probe(host)
    assert report["verdict"] == "ok"
    spawn = ["sh", "-c", "sleep 600 >/dev/null 2>&1 & echo $!"]
    pid = int(host.run(["pct", "exec", "200", "--", *spawn]).stdout)
    host.run(["pct", "stop", "200"]).check("CT 200")
    assert (
        not Path(f"/proc/{pid}").exists() or Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    )
    gpu_nodes = [n["node"] for n in report["nodes"] if n["node"][-1].isdigit()]
    assert gpu_nodes == ["/dev/nvidia0"]  # the host has 2 GPUs; the config passes through one


def gone(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat")
    return not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"


def test_destroy_stops_what_the_cts_processes_started_with_a_clean_environment(tmp_path):
    """As the supervisor starts the engine: a child with only the unit's environment."""
    root = tmp_path / "pve"
    init_host(root, gpus=1, uvm_major=511, containers="process")
    t = LocalTransport(sysroot=str(root))
    start_ct(t, RAW_GPU_CONF.format(uvm=511))
    # A detached keeper (like the supervisor) whose child has a clean environment (the engine).
    spawn = "sh -c 'env -i sleep 600 & echo $! > tmp/child.pid; wait' </dev/null >/dev/null 2>&1 &"
    t.run(["pct", "exec", "200", "--", "sh", "-c", spawn]).check("spawn")
    pidfile = root / "var/lib/ddops-sim/rootfs/200/tmp/child.pid"
    for _ in range(100):
        if pidfile.exists() and pidfile.read_text().strip():
            break
        time.sleep(0.05)
    grandchild = int(pidfile.read_text())
    assert not gone(grandchild)
    destroy_host(root)
    assert gone(grandchild)


def test_reboot_empties_shm_and_drops_uvm_nodes_until_nvidia_modprobe(host):
    start_ct(host, RAW_GPU_CONF.format(uvm=511))
    host.write_file("/tmp/model", "weights", backup=False)
    host.run(["pct", "push", "200", "/tmp/model", "/dev/shm/model"]).check("push")
    assert "model" in host.run(["pct", "exec", "200", "--", "ls", "/dev/shm"]).stdout

    report = reboot_host(Path(host.sysroot), uvm_major=509)

    assert report.stopped == report.started == [200]
    assert host.run(["pct", "exec", "200", "--", "ls", "/dev/shm"]).stdout == ""
    assert node_verdicts(probe(host))["/dev/nvidia-uvm"] == "missing"
    host.run(["nvidia-modprobe", "-u", "-c=0"]).check("nvidia-modprobe")
    host.run(["pct", "reboot", "200"]).check("CT 200")
    assert probe(host)["verdict"] == "ok"  # no device cgroup here: the stale rule goes unseen


def test_a_missing_dev_node_fails_the_start(host):
    start_ct(host, DEV_GPU_CONF)
    host.run(["pct", "stop", "200"]).check("CT 200")
    Path(host.host_path("/dev/nvidia-uvm")).unlink()
    start = host.run(["pct", "start", "200"])
    assert start.rc == 255
    assert start.stderr.startswith("Could not get mode or device ID of /dev/nvidia-uvm\n")


def test_without_root_placeholder_nodes_stand_in_for_the_gpu(tmp_path: Path):
    root = tmp_path / "pve"
    init_host(root, containers="process", device_nodes="file")
    host = LocalTransport(sysroot=str(root))
    try:
        assert host.read_text("/dev/nvidia-uvm") == "c 511:0\n"
        start_ct(host, DEV_GPU_CONF)
        assert probe(host)["verdict"] == "ok"
    finally:
        destroy_host(root)


@pytest.mark.parametrize(("version", "live"), [("9.2.11", True), ("8.2.4", False)])
def test_pct_set_dev_attaches_to_a_running_ct_on_pve_9_only(tmp_path: Path, version, live):
    root = tmp_path / "pve"
    init_host(root, gpus=1, uvm_major=511, containers="process", pve_version=version)
    t = LocalTransport(sysroot=str(root))
    start_ct(t, DEV_GPU_CONF.replace("dev3: /dev/nvidia-uvm-tools,gid=44\n", ""))
    t.run(["pct", "set", "200", "--dev3", "/dev/nvidia-uvm-tools,gid=44"]).check("pct set")
    assert node_verdicts(probe(t))["/dev/nvidia-uvm-tools"] == ("ok" if live else "missing")
    t.run(["pct", "reboot", "200"]).check("pct reboot")
    assert node_verdicts(probe(t))["/dev/nvidia-uvm-tools"] == "ok"
    destroy_host(root)
