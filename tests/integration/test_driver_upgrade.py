"""A host driver upgrade never leaves a CT's userspace behind (PVE 9.2 sim host, real LXC).

python -m pytest -q tests/integration/test_driver_upgrade.py

Where the host has libnvidia-container, the CT config carries LXC's NVIDIA mount hook (ddops' GPU
block): the CT gets the host's own userspace at each start, so after `sim upgrade --driver` and a
reboot the CT is in step with nobody acting. A CT without the hook gets it from the ct-config
check; one on a host without the tool is named, with both ways to fix it. The hook runs in
unprivileged CTs only (LXC's own hook refuses a privileged one, and the CT then fails to start):
a privileged CT never gets it. Versions compare in full: 570.148.06 is not 570.148.08.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ops.chain import checks
from ops.host.transport import LocalTransport
from ops.sim import faults
from ops.sim.host import destroy_host, init_host, reboot_host, upgrade_host
from ops.site.inventory import ContainerSpec, EngineSpec, ModelRef, ModelSpec
from tests.helpers.simhost import DEV_GPU_CONF, start_ct

OLD, NEW = "570.148.06", "570.148.08"


def sim(tmp_path: Path, *, toolkit: bool, unprivileged: bool = True) -> checks.ChainContext:
    root = tmp_path / "pve"
    init_host(root, containers="lxc", driver=OLD, container_toolkit=toolkit)
    t = LocalTransport(sysroot=str(root))
    start_ct(t, DEV_GPU_CONF + ("unprivileged: 1\n" if unprivileged else ""))
    return checks.ChainContext(
        t=t,
        ct=ContainerSpec(200, shm_gib=1),
        model=ModelSpec(ModelRef("ddops/tiny-target", name="target")),
        engine=EngineSpec(dtype="float32", device="cpu"),
    )


@pytest.mark.lxc
def test_the_mount_hook_keeps_the_cts_userspace_the_hosts_across_a_driver_upgrade(tmp_path):
    c = sim(tmp_path, toolkit=True)
    root = Path(c.t.sysroot)
    try:
        faults.set_ct_driver_version(root, 200, NEW)  # the CT's own apt moved it
        assert checks.probe_cuda(c) == checks.Finding(
            False,
            f"CT 200: driver userspace {NEW} does not match the host kernel module {OLD}: install "
            f"the {OLD} userspace in the CT (NVIDIA-Linux-x86_64-{OLD}.run --no-kernel-module), or "
            "libnvidia-container-tools on the host: ddops then mounts the host's own userspace "
            "into the CT at each start",
            fixable=False,
        )
        assert not checks.probe_ct_config(c).ok  # the hook is part of the GPU block here
        done = checks.write_ct_config(c, False)
        assert "+lxc.hook.mount: /usr/share/lxc/hooks/nvidia" in done.diff
        assert "+lxc.environment: NVIDIA_VISIBLE_DEVICES=0" in done.diff
        assert done.detail.endswith("; restarted")
        assert (
            checks.probe_cuda(c).evidence
            == f"CT 200: cuInit ok, driver {OLD} on host and in the CT"
        )

        upgrade_host(root, driver=NEW)
        mismatch = checks._userspace_mismatch(c, OLD, OLD.replace("06", "04"))
        assert not mismatch.fixable and "the host awaits a reboot into the" in mismatch.evidence
        reboot_host(root)
        c.t.run(["nvidia-modprobe", "-u", "-c=0"]).check("nodes")
        c.t.run(["pct", "start", "200"]).check("start")
        assert (
            checks.probe_cuda(c).evidence
            == f"CT 200: cuInit ok, driver {NEW} on host and in the CT"
        )
    finally:
        destroy_host(root)


@pytest.mark.lxc
def test_without_libnvidia_container_the_hook_is_not_written_and_the_fix_is_named(tmp_path):
    c = sim(tmp_path, toolkit=False)
    try:
        assert not checks.desired_gpu_block(c).host_userspace
        assert "lxc.hook.mount" not in checks.write_ct_config(c, True).diff
        faults.set_ct_driver_version(Path(c.t.sysroot), 200, NEW)
        finding = checks.probe_cuda(c)
        assert not finding.fixable and "libnvidia-container-tools on the host" in finding.evidence
    finally:
        destroy_host(Path(c.t.sysroot))


@pytest.mark.lxc
def test_a_privileged_ct_never_gets_the_hook_which_would_keep_it_from_starting(tmp_path):
    c = sim(tmp_path, toolkit=True, unprivileged=False)
    root = Path(c.t.sysroot)
    try:
        assert not checks.desired_gpu_block(c).host_userspace
        assert "lxc.hook.mount" not in checks.write_ct_config(c, True).diff
        faults.set_ct_driver_version(root, 200, NEW)
        finding = checks.probe_cuda(c)
        assert not finding.fixable
        assert finding.evidence.endswith(
            "LXC's NVIDIA mount hook, which would mount the host's own, runs in unprivileged "
            "CTs only and CT 200 is privileged"
        )
        hooked = DEV_GPU_CONF + "lxc.hook.mount: /usr/share/lxc/hooks/nvidia\n"
        c.t.run(["pct", "stop", "200"]).check("stop")
        c.t.write_file("/etc/pve/lxc/200.conf", hooked, backup=False)
        started = c.t.run(["pct", "start", "200"])
        assert started.rc != 0
        assert "FIXME: This hook currently only works in unprivileged mode." in started.stderr
    finally:
        destroy_host(root)
