"""The sim host's installed kernels and the NVIDIA driver built for them (kernel.py is the running one).

Files, as on a Proxmox host (below the sim root):
    /boot/vmlinuz-VERSION                      an installed kernel (what proxmox-boot-tool keeps)
    /lib/modules/VERSION/                      its modules directory; `build` -> its headers
                                               (a relative link here, absolute on a host)
    /usr/src/linux-headers-VERSION/            proxmox-headers-VERSION (DKMS builds need them)
    /lib/modules/VERSION/updates/dkms/nvidia.ko  the NVIDIA module DKMS built for it (here: a text
                                               file naming its version and license)
    /usr/src/nvidia-DRIVER/dkms.conf           the installed driver's DKMS sources
    /etc/kernel/proxmox-boot-pin, next-boot-pin  `proxmox-boot-tool kernel pin [--next-boot]`
    /etc/kernel/postinst.d/*                   run after a kernel install (`NAME VERSION IMAGE`)

The state names the running kernel and the kernels the installed driver's build fails on
(`dkms_broken`: a kernel too new for the driver, as 580.119 on 7.0). A build needs headers and a
driver that builds on that kernel; a new driver builds on every installed kernel.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from ops.sim.state import SimState, lock_inheriting_env, log

BOOT_DIR = "boot"
MODULES_DIR = "lib/modules"
PIN_FILE = "etc/kernel/proxmox-boot-pin"
NEXT_BOOT_PIN_FILE = "etc/kernel/next-boot-pin"
POSTINST_DIR = "etc/kernel/postinst.d"
DKMS_NAME = "nvidia"
# The modules the driver's DKMS package builds (file names use "-", module names "_").
DKMS_MODULES = ("nvidia", "nvidia-modeset", "nvidia-uvm", "nvidia-drm")
OPEN_LICENSE, PROPRIETARY_LICENSE = "Dual MIT/GPL", "NVIDIA"


def version_key(kernel: str) -> tuple[int, ...]:
    """Sort key of a kernel version ("6.17.13-4-pve" < "7.0.14-8-pve")."""
    return tuple(int(n) for n in re.findall(r"\d+", kernel))


def installed(root: Path) -> list[str]:
    """The installed kernels, oldest first."""
    images = (root / BOOT_DIR).glob("vmlinuz-*")
    return sorted((p.name.removeprefix("vmlinuz-") for p in images), key=version_key)


def module_path(root: Path, kernel: str, module: str = "nvidia") -> Path:
    return root / MODULES_DIR / kernel / "updates/dkms" / f"{module.replace('_', '-')}.ko"


def built_module(root: Path, kernel: str) -> dict[str, str] | None:
    """{"version": ..., "license": ...} of the NVIDIA module built for `kernel`; None without one."""
    try:
        text = module_path(root, kernel).read_text()
    except FileNotFoundError:
        return None
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


def has_headers(root: Path, kernel: str) -> bool:
    """Whether `kernel`'s headers are installed (its `build` link leads to them)."""
    return (root / MODULES_DIR / kernel / "build").is_dir()


def install_kernel(root: Path, state: SimState, kernel: str, *, headers: bool = True) -> None:
    """The kernel package (and its headers): image, modules directory; no NVIDIA module yet."""
    (root / BOOT_DIR).mkdir(parents=True, exist_ok=True)
    (root / BOOT_DIR / f"vmlinuz-{kernel}").write_text(f"sim kernel image {kernel}\n")
    modules = root / MODULES_DIR / kernel
    (modules / "kernel").mkdir(parents=True, exist_ok=True)
    if headers:
        source = root / f"usr/src/linux-headers-{kernel}"
        source.mkdir(parents=True, exist_ok=True)
        if not (modules / "build").is_symlink():  # relative: it resolves below the sim root
            (modules / "build").symlink_to(f"../../../usr/src/linux-headers-{kernel}")


def install_driver_sources(root: Path, state: SimState, driver: str, open_module: bool) -> None:
    """The driver package's DKMS sources (an older driver's are replaced) and its flavour."""
    for old in (root / "usr/src").glob(f"{DKMS_NAME}-*"):
        (old / "dkms.conf").unlink(missing_ok=True)
        old.rmdir()
    source = root / f"usr/src/{DKMS_NAME}-{driver}"
    source.mkdir(parents=True, exist_ok=True)
    flavour = "kernel-open" if open_module else "kernel"
    (source / "dkms.conf").write_text(
        f'PACKAGE_NAME="{DKMS_NAME}"\nPACKAGE_VERSION="{driver}"\n# sources: {flavour}\n'
    )
    state.installed_driver, state.open_module = driver, open_module


def build_error(root: Path, state: SimState, kernel: str) -> str | None:
    """Why DKMS cannot build the installed driver for `kernel` (dkms' words); None: it can."""
    if not has_headers(root, kernel):
        return (
            f"Error! Your kernel headers for kernel {kernel} cannot be found at "
            f"/lib/modules/{kernel}/build or /lib/modules/{kernel}/source.\n"
            f"Please install the proxmox-headers-{kernel} package or use the --kernelsourcedir "
            "option to tell DKMS where it's located."
        )
    if kernel in state.dkms_broken:
        return (
            f"Error! Bad return status for module build on kernel: {kernel} (x86_64)\n"
            f"Consult /var/lib/dkms/{DKMS_NAME}/{state.installed_driver}/build/make.log for more "
            "information."
        )
    return None


def build_module(root: Path, state: SimState, kernel: str) -> str | None:
    """`dkms build` + `install` of the installed driver for `kernel`; the error, None when built."""
    if error := build_error(root, state, kernel):
        return error
    license_ = OPEN_LICENSE if state.open_module else PROPRIETARY_LICENSE
    for module in DKMS_MODULES:
        path = module_path(root, kernel, module)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"version={state.installed_driver}\nlicense={license_}\n")
    return None


def remove_module(root: Path, kernel: str) -> None:
    """The NVIDIA modules gone from `kernel`'s modules directory."""
    for module in DKMS_MODULES:
        module_path(root, kernel, module).unlink(missing_ok=True)


def first_line(path: Path) -> str | None:
    try:
        lines = path.read_text().split()
    except FileNotFoundError:
        return None
    return lines[0] if lines else None


def boot_kernel(root: Path) -> str:
    """The kernel the next boot runs: the next-boot pin, else the pin, else the newest."""
    for pin in (NEXT_BOOT_PIN_FILE, PIN_FILE):
        if (kernel := first_line(root / pin)) and kernel in installed(root):
            return kernel
    return installed(root)[-1]


def run_postinst_hooks(root: Path, kernel: str) -> list[str]:
    """run-parts /etc/kernel/postinst.d with `VERSION /boot/vmlinuz-VERSION`, as a kernel
    package's postinst does; each hook's line for the sim's log. A hook runs on this machine with
    the sim host's tools first on PATH (as a CT's hookscript does)."""
    said = []
    env = lock_inheriting_env(root, dict(os.environ, SIM_ROOT=str(root)))
    env["PATH"] = f"{root / 'usr/sbin'}:{root / 'usr/bin'}:{env.get('PATH', '')}"
    hooks = sorted(p for p in (root / POSTINST_DIR).glob("*") if os.access(p, os.X_OK))
    for hook in hooks:
        argv = [str(hook), kernel, f"/boot/vmlinuz-{kernel}"]
        proc = subprocess.run(argv, env=env, capture_output=True, text=True)
        words = (proc.stdout + proc.stderr).strip().splitlines()
        said.append(f"{hook.name}: exit {proc.returncode}" + (f" ({words[-1]})" if words else ""))
        log(root, f"kernel {kernel}: postinst.d/{said[-1]}")
    return said
