"""Create, reboot and destroy a simulated Proxmox VE host (the library behind `ddops sim`).

    from ops.sim.host import init_host, reboot_host, destroy_host
    init_host(Path("/tmp/pve1"), gpus=2, ct=200)      # a healthy host with CT 200 running
    reboot_host(Path("/tmp/pve1"), uvm_major=509)     # the incident's starting point

The host's own hub (ops/sim/hubservice.py) has an address fixed here; a reboot restarts it.
A reboot stops every CT (their /dev/shm empties), unloads the modules and removes every
/dev/nvidia* node, may change the uvm major, loads `nvidia` (udev does, for the PCI device)
plus the modules named in PATH/etc/modules-load.d/*.conf, runs the boot units the sim
honours before the guests (ops/sim/boot.py), starts the CTs with `onboot: 1`, then runs
the units ordered after pve-guests.service (ddops recover).
"""

from __future__ import annotations

import os
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from ops.errors import DdopsError, InputError
from ops.sim import boot, hubservice, kernel, kernels, pveconf
from ops.sim.executables import install_host_tools
from ops.sim.nvidia import CONTAINER_CLI, LXC_NVIDIA_HOOK
from ops.sim.pct import Pct, PctError
from ops.sim.release import DEFAULT_PVE_VERSION, open_module_default, release_for
from ops.sim.state import (
    CT_CONF_DIR,
    NVIDIA_MODULES,
    SimState,
    host_lock,
    is_sim_root,
    log,
    save_state,
)

UVM_MAJOR_RANGE = (234, 511)
DEMO_CT_OPTIONS = {"hostname": "llm", "memory": "8192", "cores": "4", "onboot": "1"}


@dataclass
class BootReport:
    """What a reboot did, for humans and --json."""

    uvm_major_before: int
    uvm_major: int
    kernel: str = ""  # the kernel this boot runs
    stopped: list[int] = field(default_factory=list)
    started: list[int] = field(default_factory=list)
    failed: dict[int, str] = field(default_factory=dict)
    units: list[str] = field(default_factory=list)
    modules: list[str] = field(default_factory=list)


def lxc_available() -> bool:
    return os.geteuid() == 0 and all(
        shutil.which(t) for t in ("lxc-start", "lxc-attach", "lxc-create")
    )


def choose_containers(mode: str) -> str:
    """ "lxc" or "process" for --containers lxc|process|auto; DdopsError when lxc is impossible."""
    if mode == "auto":
        return "lxc" if lxc_available() else "process"
    if mode == "lxc" and not lxc_available():
        raise DdopsError(
            "sim", "real containers need root and Debian's lxc (apt-get install lxc busybox-static)"
        )
    return mode


def init_host(
    root: Path,
    *,
    gpus: int = 1,
    uvm_major: int = 511,
    pve_version: str = DEFAULT_PVE_VERSION,
    driver: str | None = None,
    containers: str = "auto",
    ct: int | None = None,
    device_nodes: str | None = None,
    gpu_memory_mib: int = SimState.gpu_memory_mib,
    container_toolkit: bool | None = None,
    open_module: bool | None = None,
) -> bool:
    """Make `root` a healthy sim host; False (nothing touched) when it already is one.

    `device_nodes`: "mknod" (real nodes, needs root) or "file" (placeholders); default by euid.
    `driver`: the NVIDIA driver (default: the release's, ops/sim/release.py); its module is the
    open one from 560 on, as NVIDIA's installer builds it (`open_module` says otherwise). `container_toolkit`: the host has
    libnvidia-container (LXC's NVIDIA mount hook works); default: on PVE 9.
    """
    if is_sim_root(root):
        return False
    if root.exists() and any(root.iterdir()):
        raise DdopsError(str(root), "exists and is not a simulated host: refusing to clobber it")
    if not UVM_MAJOR_RANGE[0] <= uvm_major <= UVM_MAJOR_RANGE[1]:
        raise DdopsError(
            str(root), f"--uvm-major {uvm_major} outside {UVM_MAJOR_RANGE[0]}..{UVM_MAJOR_RANGE[1]}"
        )
    try:
        release = release_for(pve_version)
    except ValueError as exc:
        raise InputError("sim init", str(exc)) from None
    driver = driver or release.driver
    state = SimState(
        pve_version=pve_version,
        kernel=release.kernel,
        driver_version=driver,
        installed_driver=driver,
        open_module=open_module_default(driver) if open_module is None else open_module,
        gpu_name=release.gpu_name,
        compute_cap=release.compute_cap,
        gpus=gpus,
        gpu_memory_mib=gpu_memory_mib,
        uvm_major=uvm_major,
        caps_major=_other_major(uvm_major),
        containers=choose_containers(containers),
        device_nodes=device_nodes or ("mknod" if os.geteuid() == 0 else "file"),
        hub_port=hubservice.free_port(),  # the host's hub address, for good (started on demand)
    )
    for sub in (CT_CONF_DIR, "etc/modules-load.d", "etc/systemd/system", "dev", "root", "tmp"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    (root / "etc/hostname").write_text(state.node + "\n")
    install_host_tools(root)
    kernels.install_kernel(root, state, state.kernel)
    kernels.install_driver_sources(root, state, driver, state.open_module)
    kernels.build_module(root, state, state.kernel)
    if release.container_toolkit if container_toolkit is None else container_toolkit:
        _install_container_toolkit(root)
    kernel.write_proc(root, state)
    kernel.load_module(root, state, "nvidia")
    kernel.create_uvm_nodes(root, state)
    save_state(root, state)
    log(
        root,
        f"sim host created: {gpus} GPU(s), uvm major {uvm_major}, containers: {state.containers}",
    )
    if ct is not None:
        _create_demo_ct(root, ct)
    return True


def _install_container_toolkit(root: Path) -> None:
    """LXC's NVIDIA mount hook and libnvidia-container's tool, as files: pct's start honours the
    hook (the CT gets the host's userspace); neither is ever run."""
    for path, text in (
        (
            LXC_NVIDIA_HOOK,
            "#!/bin/sh\n# LXC's NVIDIA mount hook (the ddops sim: pct start honours it)\n",
        ),
        (CONTAINER_CLI, "#!/bin/sh\necho 'cli-version: 1.18.0'\n"),
    ):
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
        (root / path).chmod(0o755)


def _create_demo_ct(root: Path, vmid: int) -> None:
    with host_lock(root):
        pct = Pct(root)
        try:
            pct.create(
                vmid, "local:vztmpl/debian-12-standard_12.7-1_amd64.tar.zst", DEMO_CT_OPTIONS
            )
            pct.start(vmid)
        except PctError as exc:
            raise DdopsError(f"CT {vmid}", str(exc).replace("\n", ": ")) from None
        finally:
            save_state(root, pct.state)


def _other_major(uvm_major: int) -> int:
    """nvidia-caps gets the next dynamic major the kernel hands out (below uvm's, like real hosts)."""
    return uvm_major - 1 if uvm_major > UVM_MAJOR_RANGE[0] else uvm_major + 1


def reboot_host(root: Path, *, uvm_major: int | None = None) -> BootReport:
    """Power-cycle the sim host; `uvm_major` None = a new random one differing from the old."""
    with host_lock(root):
        pct = Pct(root)
        state = pct.state
        report = BootReport(uvm_major_before=state.uvm_major, uvm_major=state.uvm_major)
        for vmid in pct.vmids():
            if pct.cts.is_running(vmid):
                pct.cts.stop(vmid)
                report.stopped.append(vmid)
        kernel.power_off(root, state)
        state.kernel = report.kernel = kernels.boot_kernel(root)
        (root / kernels.NEXT_BOOT_PIN_FILE).unlink(missing_ok=True)  # proxmox-boot-cleanup
        state.uvm_major = uvm_major if uvm_major is not None else _new_major(state.uvm_major)
        state.caps_major = _other_major(state.uvm_major)
        state.boots += 1
        report.uvm_major = state.uvm_major
        _load_boot_modules(root, state)
        save_state(root, state)
        report.modules = list(state.modules)
    log(
        root,
        f"boot {state.boots}: kernel {state.kernel}, "
        f"uvm major {report.uvm_major_before} -> {report.uvm_major}",
    )
    if hubservice.stop_hub(root):  # the host's services come back with it
        hubservice.ensure_hub(root)
    report.units = boot.run_boot_units(root, after_guests_started=False)
    _start_onboot(root, report)
    report.units += boot.run_boot_units(root, after_guests_started=True)
    return report


def _load_boot_modules(root: Path, state: SimState) -> None:
    """nvidia (udev, for the PCI device) and the modules-load.d names, where the kernel has them."""
    for module in ["nvidia", *boot.modules_to_load(root)]:
        if module in NVIDIA_MODULES:
            try:
                kernel.load_module(root, state, module)
            except kernel.ModuleMissing:
                log(root, f"boot: systemd-modules-load: Failed to find module '{module}'")


def _new_major(old: int) -> int:
    majors = [m for m in range(UVM_MAJOR_RANGE[0], UVM_MAJOR_RANGE[1] + 1) if m != old]
    return random.choice(majors)  # nosec B311 - a simulated device major, not a secret


def _start_onboot(root: Path, report: BootReport) -> None:
    with host_lock(root):
        pct = Pct(root)  # boot units may have changed the state (nvidia-modprobe)
        for vmid in pct.vmids():
            if pveconf.values(pct.conf(vmid)).get("onboot") == "1":
                try:
                    pct.start(vmid)
                    report.started.append(vmid)
                except PctError as exc:
                    report.failed[vmid] = str(exc).splitlines()[0]
                    log(root, f"CT {vmid}: onboot start failed: {report.failed[vmid]}")
        save_state(root, pct.state)


@dataclass
class UpgradeReport:
    """What `ddops sim upgrade` installed, and what DKMS and the kernel hooks said."""

    kernel: str | None = None
    driver: str | None = None
    built: dict[str, str] = field(default_factory=dict)  # kernel -> "ok" | dkms' first error line
    hooks: list[str] = field(default_factory=list)


def upgrade_host(
    root: Path,
    *,
    kernel_version: str | None = None,
    dkms_ok: bool = True,
    driver: str | None = None,
) -> UpgradeReport:
    """Install a kernel (its DKMS build of the NVIDIA driver succeeding or failing, then the
    postinst.d hooks), or a new driver (its module built for every installed kernel, loaded at the
    next boot; the host's userspace is the new one at once)."""
    if not is_sim_root(root):
        raise DdopsError(str(root), "not a simulated host")
    report = UpgradeReport(kernel=kernel_version, driver=driver)
    with host_lock(root):
        state = Pct(root).state
        if driver:
            kernels.install_driver_sources(root, state, driver, open_module_default(driver))
            state.dkms_broken = []  # a new driver: its build is tried afresh on every kernel
            targets = kernels.installed(root)
            for target in targets:  # the old package's modules go with it (dkms remove --all)
                kernels.remove_module(root, target)
        else:
            kernels.install_kernel(root, state, kernel_version)
            if not dkms_ok and kernel_version not in state.dkms_broken:
                state.dkms_broken.append(kernel_version)
            targets = [kernel_version]
        for target in targets:
            error = kernels.build_module(root, state, target)
            report.built[target] = error.splitlines()[0] if error else "ok"
        save_state(root, state)
    log(
        root,
        f"upgrade: {'driver ' + driver if driver else 'kernel ' + kernel_version}: {report.built}",
    )
    if kernel_version:
        report.hooks = kernels.run_postinst_hooks(root, kernel_version)
    return report


def destroy_host(root: Path) -> list[int]:
    """Stop and destroy every CT, then remove the sim root; the CTs destroyed."""
    if not is_sim_root(root):
        raise DdopsError(str(root), "not a simulated host: refusing to delete it")
    with host_lock(root):
        pct = Pct(root)
        destroyed = pct.vmids()
        for vmid in destroyed:
            if pct.cts.is_running(vmid):
                pct.cts.stop(vmid)
            pct.cts.destroy(vmid)
    hubservice.stop_hub(root)
    shutil.rmtree(root)
    return destroyed
