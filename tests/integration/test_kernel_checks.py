"""The chain's kernel checks on a PVE 9.2 sim host (plain-process CTs: no container is needed).

python -m pytest -q tests/integration/test_kernel_checks.py

A kernel whose NVIDIA DKMS build failed: the kernel hook pins the running kernel and health says
so; the `boot-kernel` check warns before a reboot into it and recover pins (or lifts ddops' pin);
a running kernel without the module is named in one line with the way back, and rebuilt by
`dkms autoinstall -k` where that can work.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ops.chain import checks
from ops.chain.setup import install_boot
from ops.errors import DdopsError
from ops.host.kernels import PIN_RECORD, read_pin_record
from ops.host.transport import LocalTransport
from ops.sim import faults
from ops.sim.host import destroy_host, init_host, reboot_host, upgrade_host
from ops.site.inventory import ContainerSpec, EngineSpec, HostSpec, ModelRef, ModelSpec

OLD, BAD, GOOD = "7.0.14-8-pve", "7.0.14-9-pve", "7.0.14-10-pve"
PIN = f"`proxmox-boot-tool kernel pin {OLD} --next-boot` and reboot"


@pytest.fixture
def c(tmp_path: Path):
    root = tmp_path / "pve"
    init_host(root, containers="process")
    t = LocalTransport(sysroot=str(root))
    host = HostSpec("sim", f"sim:{root}", (ContainerSpec(200), ContainerSpec(201)))
    yield checks.ChainContext(
        t=t,
        ct=host.containers[0],
        model=ModelSpec(ModelRef("ddops/tiny-target", name="target")),
        engine=EngineSpec(dtype="float32", device="cpu"),
        host=host,
    )
    destroy_host(root)


def root(c) -> Path:
    return Path(c.t.sysroot)


def test_the_hook_pins_the_running_kernel_and_lifts_the_pin_once_a_newer_one_has_the_module(c):
    install_boot(c.t, checks._boot_specs(c), dry_run=False)
    report = upgrade_host(root(c), kernel_version=BAD, dkms_ok=False)
    assert report.hooks == [
        f"zz-ddops-nvidia: exit 0 (ddops: {BAD} got no nvidia module: pinned {OLD} for the next "
        "boots (see ddops health))"
    ]
    assert read_pin_record(c.t).pinned == OLD
    finding = checks.probe_boot_kernel(c)
    assert finding.ok and finding.evidence.startswith(
        f"sim:{root(c)}: running {OLD}, next boot {OLD}; warning: {BAD} got no nvidia module, so "
        f"ddops pinned {OLD} ("
    )
    assert reboot_host(root(c)).kernel == OLD  # the pin holds: CUDA stays

    upgrade_host(root(c), kernel_version=GOOD)  # a newer kernel that builds: the hook lifts it
    assert not c.t.exists(PIN_RECORD)
    assert checks.probe_boot_kernel(c).evidence.endswith(
        f"next boot {GOOD}, which has nvidia 590.48.01"
    )


def test_health_warns_before_a_reboot_into_a_kernel_without_the_module_and_recover_pins(c):
    upgrade_host(root(c), kernel_version=BAD, dkms_ok=False)  # no hook installed
    finding = checks.probe_boot_kernel(c)
    assert not finding.ok and finding.fixable
    assert f"next boot {BAD}, which has no nvidia module (driver 590.48.01; dkms status: " in (
        finding.evidence
    )
    assert "a reboot now would leave CT(s) 200, 201 without CUDA" in finding.evidence
    assert checks.pin_boot_kernel(c, True).detail.startswith(
        f"would run `proxmox-boot-tool kernel pin {OLD}`"
    )
    assert not c.t.exists(PIN_RECORD)  # a dry run changes nothing
    checks.pin_boot_kernel(c, False)
    assert checks.probe_boot_kernel(c).ok and read_pin_record(c.t).new == BAD

    upgrade_host(root(c), driver="590.48.02")  # a fixed driver builds for the new kernel too
    lift = checks.probe_boot_kernel(c)
    assert not lift.ok and lift.evidence.endswith(f"{BAD} has one now: the pin can go")
    assert checks.pin_boot_kernel(c, False).detail == (
        f"lifted ddops' pin of {OLD}: the next boot runs {BAD}"
    )
    assert checks.probe_boot_kernel(c).ok and not c.t.exists(PIN_RECORD)


def test_a_pin_set_by_hand_is_left_alone(c):
    upgrade_host(root(c), kernel_version=BAD, dkms_ok=False)
    c.t.run(["proxmox-boot-tool", "kernel", "pin", BAD]).check("pin")
    finding = checks.probe_boot_kernel(c)
    assert not finding.ok and not finding.fixable
    assert finding.evidence.endswith(
        f"{BAD} is pinned by hand: `proxmox-boot-tool kernel pin {OLD}` keeps the running kernel"
    )


def test_a_running_kernel_without_the_module_is_named_with_the_way_back(c):
    upgrade_host(root(c), kernel_version=BAD, dkms_ok=False)
    reboot_host(root(c))  # no hook: the new kernel boots, without nvidia
    finding = checks.probe_modules(c)
    assert not finding.ok and "\n" not in finding.evidence
    assert finding.evidence == (
        f"sim:{root(c)}: running kernel {BAD} has no nvidia module (driver 590.48.01; dkms "
        f"status: nvidia/590.48.01, {OLD}, x86_64: installed; installed kernels with the module: "
        f"{OLD}): rebuild it (`dkms autoinstall -k {BAD}`, with proxmox-headers-{BAD}) or boot "
        f"{OLD} again: {PIN}"
    )
    with pytest.raises(DdopsError) as failed:
        checks.load_modules(c, False)
    assert str(failed.value).endswith(
        f"`dkms autoinstall -k {BAD}` failed (Error! Bad return status for module build on "
        f"kernel: {BAD} (x86_64)); boot {OLD} again: {PIN}"
    )


def test_a_module_dkms_can_rebuild_is_rebuilt_then_loaded(c):
    faults.remove_kernel_module(root(c), OLD)
    reboot_host(root(c))
    assert not checks.probe_modules(c).ok
    assert checks.load_modules(c, True).detail == (
        f"would run `dkms autoinstall -k {OLD}`, then `modprobe -a nvidia nvidia_uvm`"
    )
    done = checks.load_modules(c, False)
    assert done.detail == f"ran `dkms autoinstall -k {OLD}`; ran `modprobe -a nvidia nvidia_uvm`"
    assert checks.probe_modules(c).ok
