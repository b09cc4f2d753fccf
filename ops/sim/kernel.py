"""The simulated kernel: nvidia modules, /proc files and the fake GPU device nodes.

Loading `nvidia` registers major 195 and, as the driver package's udev rule does on a
Proxmox host, creates /dev/nvidia0..N, /dev/nvidiactl and /dev/nvidia-modeset. `nvidia_uvm`
registers the dynamic uvm major, but its nodes appear only when `nvidia-modprobe -u` runs
(see `create_uvm_nodes`). Nodes are real character devices (`mknod`) with no driver behind
them, or, without root, placeholder files holding "c MAJOR:MINOR".
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from ops.sim import kernels
from ops.sim.state import NVIDIA_MODULES, SimState

NVIDIA_MAJOR = 195
CTL_MINOR = 255
MODESET_MINOR = 254
MODULE_DEPS = {
    "nvidia_modeset": ["nvidia"],
    "nvidia_uvm": ["nvidia"],
    "nvidia_drm": ["nvidia_modeset"],
}
MODULE_SIZES = {
    "nvidia": 56717312,
    "nvidia_modeset": 1548288,
    "nvidia_uvm": 1531904,
    "nvidia_drm": 90112,
}
BASE_CHAR_DEVICES = [
    (1, "mem"), (4, "/dev/vc/0"), (4, "tty"), (5, "/dev/tty"), (5, "/dev/console"),
    (5, "/dev/ptmx"), (7, "vcs"), (10, "misc"), (13, "input"), (136, "pts"), (180, "usb"),
    (226, "drm"),
]  # fmt: skip
BLOCK_DEVICES = [(7, "loop"), (8, "sd"), (259, "blkext")]


def gpu_node_numbers(state: SimState) -> dict[str, tuple[int, int]]:
    """/dev name -> (major, minor) of the nodes the nvidia module owns."""
    nodes = {f"nvidia{i}": (NVIDIA_MAJOR, i) for i in range(state.gpus)}
    nodes["nvidiactl"] = (NVIDIA_MAJOR, CTL_MINOR)
    nodes["nvidia-modeset"] = (NVIDIA_MAJOR, MODESET_MINOR)
    return nodes


def uvm_node_numbers(state: SimState) -> dict[str, tuple[int, int]]:
    return {"nvidia-uvm": (state.uvm_major, 0), "nvidia-uvm-tools": (state.uvm_major, 1)}


def make_node(path: Path, major: int, minor: int, kind: str, mode: int = 0o666) -> None:
    """A character node (or a placeholder file without root), replacing whatever was there."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() or path.is_symlink():
        path.unlink()
    if kind == "mknod":
        os.mknod(path, stat.S_IFCHR | mode, os.makedev(major, minor))
        os.chmod(path, mode)
    else:
        path.write_text(f"c {major}:{minor}\n")


def node_numbers(path: Path) -> tuple[int, int] | None:
    """(major, minor) of a character node or placeholder; None when absent or something else."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    if stat.S_ISCHR(st.st_mode):
        return os.major(st.st_rdev), os.minor(st.st_rdev)
    if stat.S_ISREG(st.st_mode) and st.st_size < 64:
        kind, _, numbers = path.read_text().strip().partition(" ")
        major, _, minor = numbers.partition(":")
        if kind == "c" and major.isdigit() and minor.isdigit():
            return int(major), int(minor)
    return None


class ModuleMissing(Exception):
    """The running kernel has no such module; the message is modprobe's."""


def load_module(root: Path, state: SimState, name: str) -> None:
    """Load `name` and what it depends on (idempotent, like modprobe); ModuleMissing when the
    running kernel's modules directory has no build of it."""
    if name not in NVIDIA_MODULES:
        raise ValueError(name)
    for dep in MODULE_DEPS.get(name, []):
        load_module(root, state, dep)
    if state.module_loaded(name):
        return
    built = kernels.built_module(root, state.kernel)
    if built is None:
        raise ModuleMissing(
            f"modprobe: FATAL: Module {name} not found in directory /lib/modules/{state.kernel}"
        )
    state.modules.append(name)
    if name == "nvidia":
        state.driver_version = built["version"]
        for node, (major, minor) in gpu_node_numbers(state).items():
            make_node(root / "dev" / node, major, minor, state.device_nodes)
    write_proc(root, state)


def create_uvm_nodes(root: Path, state: SimState) -> None:
    """What `nvidia-modprobe -u -c=0` does: load nvidia_uvm, (re)create its nodes, current major."""
    load_module(root, state, "nvidia_uvm")
    for node, (major, minor) in uvm_node_numbers(state).items():
        make_node(root / "dev" / node, major, minor, state.device_nodes)


def power_off(root: Path, state: SimState) -> None:
    """Every module unloaded, every nvidia node gone (/dev is a devtmpfs on a real host)."""
    state.modules = []
    for node in (root / "dev").glob("nvidia*"):
        node.unlink()
    write_proc(root, state)


def write_proc(root: Path, state: SimState) -> None:
    """Render /proc/devices, /proc/modules and /proc/driver/nvidia/version from the state."""
    proc = root / "proc"
    (proc / "driver/nvidia").mkdir(parents=True, exist_ok=True)
    (proc / "devices").write_text(_proc_devices(state))
    (proc / "modules").write_text(_proc_modules(state))
    version = proc / "driver/nvidia/version"
    if state.module_loaded("nvidia"):
        version.write_text(version_line(root, state))
    elif version.exists():
        version.unlink()


def version_line(root: Path, state: SimState) -> str:
    """/proc/driver/nvidia/version of the loaded module, in its flavour's words."""
    built = kernels.built_module(root, state.kernel) or {}
    if built.get("license") == kernels.OPEN_LICENSE:
        first = (
            f"NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  {state.driver_version}  "
            "Release Build  (dvs-builder@U22-I3-B17-02-5)  Tue Nov 18 20:24:10 UTC 2025"
        )
    else:
        first = (
            f"NVRM version: NVIDIA UNIX x86_64 Kernel Module  {state.driver_version}  "
            "Fri May 31 09:35:42 UTC 2024"
        )
    return f"{first}\nGCC version:  gcc version 14.2.0 (Debian 14.2.0-19)\n"


def _proc_devices(state: SimState) -> str:
    chars = list(BASE_CHAR_DEVICES)
    if state.module_loaded("nvidia"):
        chars += [(NVIDIA_MAJOR, "nvidia"), (state.caps_major, "nvidia-caps")]
    if state.module_loaded("nvidia_uvm"):
        chars.append((state.uvm_major, "nvidia-uvm"))
    lines = ["Character devices:"]
    lines += [f"{major:3d} {name}" for major, name in sorted(chars, key=lambda c: c[0])]
    lines += ["", "Block devices:"] + [f"{major:3d} {name}" for major, name in BLOCK_DEVICES]
    return "\n".join(lines) + "\n"


def _proc_modules(state: SimState) -> str:
    users = {m: [u for u in state.modules if m in MODULE_DEPS.get(u, [])] for m in state.modules}
    lines = []
    for name in reversed(state.modules):  # the kernel lists the newest module first
        used_by = "".join(f"{u}," for u in users[name]) or "-"
        lines.append(
            f"{name} {MODULE_SIZES[name]} {len(users[name])} {used_by} Live 0x0000000000000000"
        )
    return "\n".join(lines) + ("\n" if lines else "")
