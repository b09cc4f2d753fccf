"""The sim host's kernels, DKMS and driver upgrades, as the real tools show them (no containers).

python -m pytest -q tests/sim/test_kernels.py
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from ops.cli import cli
from ops.host.transport import LocalTransport
from ops.sim import faults
from ops.sim.host import init_host, reboot_host, upgrade_host

NEW = "7.0.14-9-pve"


@pytest.fixture
def t(tmp_path: Path) -> LocalTransport:
    init_host(tmp_path / "pve", containers="process")
    return LocalTransport(sysroot=str(tmp_path / "pve"))


def root(t: LocalTransport) -> Path:
    return Path(t.sysroot)


def test_a_failed_dkms_build_leaves_the_new_kernel_without_a_module(t):
    result = CliRunner().invoke(
        cli, ["--json", "sim", "upgrade", t.sysroot, "--kernel", NEW, "--dkms", "fail"]
    )
    assert result.exit_code == 0
    assert json.loads(result.output)["built"][NEW].startswith("Error! Bad return status")
    assert t.run(["dkms", "status"]).stdout == "nvidia/590.48.01, 7.0.14-8-pve, x86_64: installed\n"
    assert (
        t.run(["modinfo", "-k", "7.0.14-8-pve", "-F", "version", "nvidia"]).stdout == "590.48.01\n"
    )
    missing = t.run(["modinfo", "-k", NEW, "nvidia"])
    assert (missing.rc, missing.stderr) == (1, "modinfo: ERROR: Module nvidia not found.\n")
    rebuild = t.run(["dkms", "autoinstall", "-k", NEW])
    assert rebuild.rc == 11 and "Error! Bad return status for module build" in rebuild.stderr
    listed = t.run(["proxmox-boot-tool", "kernel", "list"]).stdout
    assert "Automatically selected kernels:\n7.0.14-9-pve\n7.0.14-8-pve\n" in listed
    assert "Pinned kernel" not in listed

    booted = reboot_host(root(t))  # no pin: the newest kernel boots, without nvidia
    assert (booted.kernel, booted.modules) == (NEW, [])
    assert t.run(["uname", "-r"]).stdout == f"{NEW}\n"
    modprobe = t.run(["modprobe", "nvidia"])
    assert (modprobe.rc, modprobe.stderr) == (
        1,
        f"modprobe: FATAL: Module nvidia not found in directory /lib/modules/{NEW}\n",
    )
    assert t.run(["nvidia-modprobe", "-u", "-c=0"]).rc == 1


def test_pins_choose_the_next_boot_and_a_next_boot_pin_lasts_one_boot(t):
    upgrade_host(root(t), kernel_version=NEW)
    pin = t.run(["proxmox-boot-tool", "kernel", "pin", "7.0.14-8-pve"])
    assert pin.rc == 0 and "Set kernel '7.0.14-8-pve' in /etc/kernel/proxmox-boot-pin" in pin.stdout
    assert reboot_host(root(t)).kernel == "7.0.14-8-pve"
    t.run(["proxmox-boot-tool", "kernel", "pin", NEW, "--next-boot"]).check("pin")
    assert (
        "Kernel pinned on next-boot:\n7.0.14-9-pve"
        in t.run(["proxmox-boot-tool", "kernel", "list"]).stdout
    )
    assert reboot_host(root(t)).kernel == NEW
    assert reboot_host(root(t)).kernel == "7.0.14-8-pve"  # the pin again
    absent = t.run(["proxmox-boot-tool", "kernel", "pin", "6.1.0-1-pve"])
    assert absent.rc == 1 and "E: no kernel image found in /boot for '6.1.0-1-pve'" in absent.stderr
    t.run(["proxmox-boot-tool", "kernel", "unpin"]).check("unpin")
    assert reboot_host(root(t)).kernel == NEW


def test_dkms_rebuilds_a_removed_module_when_headers_are_there(t):
    faults.remove_kernel_module(root(t), "7.0.14-8-pve")
    assert t.run(["dkms", "status"]).stdout == "nvidia/590.48.01: added\n"
    rebuilt = t.run(["dkms", "autoinstall", "-k", "7.0.14-8-pve"])
    assert rebuilt.rc == 0 and "succeeded for module(s) nvidia" in rebuilt.stdout
    assert t.run(["modprobe", "nvidia"]).rc == 0


def test_a_driver_upgrade_is_built_for_every_kernel_and_loaded_at_the_next_boot(t):
    upgrade_host(root(t), kernel_version=NEW, dkms_ok=False)
    report = upgrade_host(root(t), driver="590.48.02")
    assert report.built == {"7.0.14-8-pve": "ok", NEW: "ok"}  # the new driver builds on both
    smi = t.run(["nvidia-smi", "-L"])  # userspace is new, the loaded module still the old
    assert smi.rc == 18 and "Driver/library version mismatch" in smi.stdout
    assert "590.48.01" in t.read_text("/proc/driver/nvidia/version")
    reboot_host(root(t))
    assert "Open Kernel Module for x86_64  590.48.02" in t.read_text("/proc/driver/nvidia/version")
    assert t.run(["nvidia-smi", "-L"]).rc == 0
