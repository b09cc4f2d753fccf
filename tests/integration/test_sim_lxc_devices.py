"""Simulated `pct` in real LXC containers: messages, locks, a missing devN node, driver mismatch.

python -m pytest -q tests/integration/test_sim_lxc_devices.py
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ops.sim import faults
from ops.sim.host import reboot_host
from tests.helpers.simhost import DEV_GPU_CONF, RAW_GPU_CONF, probe, sim_host, start_ct

pytestmark = pytest.mark.lxc


@pytest.fixture
def host(tmp_path: Path):
    yield from sim_host(tmp_path)


def test_pct_refuses_to_start_a_running_or_locked_ct_with_the_real_messages(host):
    start_ct(host, RAW_GPU_CONF.format(uvm=511))
    env = host.run(["pct", "exec", "200", "--", "printenv", "DDOPS_T"], env={"DDOPS_T": "x1"})
    assert env.stdout == "x1\n"  # pct exec keeps the caller's environment (secrets travel so)
    again = host.run(["pct", "start", "200"])
    assert (again.rc, again.stderr.strip()) == (255, "CT 200 already running")
    faults.lock_ct(Path(host.sysroot), 200, "backup")
    locked = host.run(["pct", "stop", "200"])
    assert (locked.rc, locked.stderr.strip()) == (255, "CT is locked (backup)")
    host.run(["pct", "unlock", "200"]).check("CT 200")
    host.run(["pct", "stop", "200"]).check("CT 200")
    assert host.run(["pct", "status", "200"]).stdout == "status: stopped\n"
    stopped = host.run(["pct", "exec", "200", "--", "true"])
    assert (stopped.rc, stopped.stderr.strip()) == (255, "CT 200 not running")


def test_a_missing_dev_node_makes_the_start_fail_loudly(host):
    start_ct(host, DEV_GPU_CONF)
    report = reboot_host(Path(host.sysroot), uvm_major=400)  # no unit runs nvidia-modprobe
    assert report.failed == {200: "Could not get mode or device ID of /dev/nvidia-uvm"}
    start = host.run(["pct", "start", "200"])
    assert start.rc == 255
    assert start.stderr.splitlines() == [
        "Could not get mode or device ID of /dev/nvidia-uvm",
        "startup for container '200' failed",
    ]


def test_a_driver_userspace_mismatch_fails_cuinit_and_nvidia_smi(host):
    start_ct(host, RAW_GPU_CONF.format(uvm=511))
    faults.set_ct_driver_version(Path(host.sysroot), 200, "550.54.14")
    report = probe(host)
    assert (report["verdict"], report["cuda"]["cuInit"]) == ("mismatch", 803)
    assert report["userspace_driver_version"] == "550.54.14"
    smi = host.run(["pct", "exec", "200", "--", "nvidia-smi"])
    assert smi.rc == 18 and "Driver/library version mismatch" in smi.stdout
