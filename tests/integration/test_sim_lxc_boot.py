"""Boot-time behaviour of the simulated host in real LXC containers: units, hookscripts, devN.

python -m pytest -q tests/integration/test_sim_lxc_boot.py
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ops.sim.host import reboot_host
from tests.helpers.simhost import DEV_GPU_CONF, probe, sim_host, start_ct

pytestmark = pytest.mark.lxc


@pytest.fixture
def host(tmp_path: Path):
    yield from sim_host(tmp_path)


def test_dev_entries_grant_the_major_the_node_has_at_each_start(host):
    root = Path(host.sysroot)
    host.write_file("/etc/modules-load.d/nvidia.conf", "nvidia\nnvidia_uvm\n", backup=False)
    host.write_file(
        "/etc/systemd/system/nvidia-uvm-nodes.service",
        "[Unit]\nBefore=pve-guests.service\n[Service]\nType=oneshot\n"
        "ExecStart=/usr/bin/nvidia-modprobe -u -c=0\n[Install]\nWantedBy=multi-user.target\n",
        backup=False,
    )
    host.write_file("/etc/systemd/system/multi-user.target.wants/nvidia-uvm-nodes.service", "")
    start_ct(host, DEV_GPU_CONF)
    assert probe(host)["verdict"] == "ok"

    report = reboot_host(root, uvm_major=300)

    assert report.units == ["nvidia-uvm-nodes"] and report.started == [200]
    after = probe(host)
    assert after["verdict"] == "ok"
    assert {n["node"]: n.get("device") for n in after["nodes"]}["/dev/nvidia-uvm"] == "300:0"


def test_a_pre_start_hookscript_runs_before_dev_entries_resolve_and_can_abort_the_start(host):
    hook = '#!/bin/sh\n[ "$2" = pre-start ] || exit 0\nnvidia-modprobe -u -c=0\ntest ! -e "$SIM_ROOT/tmp/refuse"\n'
    host.write_file("/var/lib/vz/snippets/hook.sh", hook, mode=0o755, backup=False)
    start_ct(host, DEV_GPU_CONF + "hookscript: local:snippets/hook.sh\n")
    report = reboot_host(Path(host.sysroot), uvm_major=260)  # no unit: only the hook makes nodes
    assert report.started == [200]
    assert {n["node"]: n.get("device") for n in probe(host)["nodes"]}["/dev/nvidia-uvm"] == "260:0"
    host.run(["pct", "stop", "200"]).check("CT 200")
    host.write_file("/tmp/refuse", "", backup=False)
    start = host.run(["pct", "start", "200"])
    assert start.rc == 255 and start.stderr.splitlines()[0] == (
        "hookscript error for 200 on pre-start: "
        "command '/var/lib/vz/snippets/hook.sh 200 pre-start' failed: exit code 1"
    )
