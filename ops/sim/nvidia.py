"""The sim's stand-ins for nvidia-smi, nvidia-modprobe, modprobe, lsmod and pveversion.

Each takes its argv (without the program name) and returns an exit code, printing what the real
tool prints for the uses ddops has. On the host they read the sim state; inside a CT,
`nvidia-smi` reads the CT's driver userspace description /etc/ddops-sim/nvidia.json (the sim's
stand-in for the libnvidia-ml the CT has installed) and opens /dev/nvidiactl as NVML does:
it lists the GPUs even when /dev/nvidia-uvm is blocked (the incident).
"""

from __future__ import annotations

import errno
import json
import os
import sys
import uuid
from pathlib import Path

from ops.sim import kernel, kernels
from ops.sim.release import release_for
from ops.sim.state import NVIDIA_MODULES, SimState, host_lock, load_state, save_state

CUDA_VERSION = "12.4"
CT_USERSPACE_FILE = "etc/ddops-sim/nvidia.json"
# LXC's NVIDIA mount hook, and the libnvidia-container tool it calls (on the host)
LXC_NVIDIA_HOOK = "usr/share/lxc/hooks/nvidia"
CONTAINER_CLI = "usr/bin/nvidia-container-cli"
NO_DRIVER = (
    "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
    "Make sure that the latest NVIDIA driver is installed and running."
)
QUERY_FIELDS = {
    "index": lambda g: str(g["index"]),
    "name": lambda g: g["name"],
    "compute_cap": lambda g: g["compute_cap"],
    "uuid": lambda g: g["uuid"],
    "driver_version": lambda g: g["driver_version"],
    "memory.total": lambda g: f"{g['memory_mib']} MiB",
    "memory.used": lambda g: "0 MiB",
    "memory.free": lambda g: f"{g['memory_mib']} MiB",
    "utilization.gpu": lambda g: "0 %",
    "pci.bus_id": lambda g: f"00000000:{0x41 + g['index']:02X}:00.0",
    # An idle card at its idle clocks (the bench records them: engine/machine_state.py).
    "clocks.sm": lambda g: "180 MHz",
    "clocks.max.sm": lambda g: "3090 MHz",
    "clocks.mem": lambda g: "405 MHz",
    "temperature.gpu": lambda g: "34",
}
PCI_IDS = {  # lspci's chip and device id of the sim's GPUs
    "NVIDIA RTX PRO 6000 Blackwell Workstation Edition": ("GB202GL", "2bb1"),
    "NVIDIA RTX 6000 Ada Generation": ("AD102GL", "26b1"),
}
APP_FIELDS = ("pid", "process_name", "used_memory")  # no process runs on the sim's GPUs


def gpu_uuid(node: str, index: int) -> str:
    return f"GPU-{uuid.uuid5(uuid.NAMESPACE_DNS, f'{node}.gpu{index}.ddops-sim')}"


def nvidia_smi_host(root: Path, args: list[str]) -> int:
    state = load_state(root)
    if not state.module_loaded("nvidia"):
        print(NO_DRIVER)
        return 9
    if not _module_drives(root, state):
        print("No devices were found")
        return 6
    if state.installed_driver != state.driver_version:  # upgraded, not yet rebooted
        print("Failed to initialize NVML: Driver/library version mismatch")
        print(f"NVML library version: {state.installed_driver}")
        return 18
    gpus = _gpus(state.node, state.gpus, state.driver_version, state.gpu_memory_mib, _model(state))
    return _print_gpus(gpus, args)


def _module_drives(root: Path, state: SimState) -> bool:
    """The proprietary module drives no Blackwell GPU (compute capability 10 and up)."""
    built = kernels.built_module(root, state.kernel) or {}
    return built.get("license") == kernels.OPEN_LICENSE or int(state.compute_cap.split(".")[0]) < 10


def lspci(root: Path, args: list[str]) -> int:
    """`lspci -nn -d 10de:`: the NVIDIA GPUs on the PCI bus, whatever module is loaded."""
    state = load_state(root)
    chip, device = PCI_IDS.get(state.gpu_name, ("GA102GL", "2230"))
    name = state.gpu_name.removeprefix("NVIDIA ")
    for i in range(state.gpus):
        print(
            f"{0x41 + i:02x}:00.0 VGA compatible controller [0300]: NVIDIA Corporation {chip} "
            f"[{name}] [10de:{device}] (rev a1)"
        )
    return 0


def _model(state: SimState) -> dict[str, str]:
    return {"name": state.gpu_name, "compute_cap": state.compute_cap}


def nvidia_smi_ct(ct_root: Path, args: list[str]) -> int:
    """nvidia-smi as seen inside a CT whose root is `ct_root` ("/" inside a real container)."""
    try:
        userspace = json.loads((ct_root / CT_USERSPACE_FILE).read_text())
    except FileNotFoundError:
        print("nvidia-smi: command not found", file=sys.stderr)
        return 127
    try:
        os.close(os.open(ct_root / "dev/nvidiactl", os.O_RDWR))
    except OSError as exc:
        if exc.errno not in (errno.ENXIO, errno.ENODEV):
            print(NO_DRIVER)
            return 9
    if userspace["userspace_version"] != userspace.get("kernel_module_version"):
        print("Failed to initialize NVML: Driver/library version mismatch")
        print(f"NVML library version: {userspace['userspace_version']}")
        return 18
    memory = userspace.get("gpu_memory_mib", SimState.gpu_memory_mib)
    model = {
        "name": userspace.get("gpu_name", SimState.gpu_name),
        "compute_cap": userspace.get("compute_cap", SimState.compute_cap),
    }
    gpus = _gpus(
        userspace["node"], userspace["gpus"], userspace["userspace_version"], memory, model
    )
    return _print_gpus(gpus, args)


def _gpus(node: str, count: int, driver: str, memory_mib: int, model: dict) -> list[dict]:
    return [
        {
            "index": i,
            "uuid": gpu_uuid(node, i),
            "driver_version": driver,
            "memory_mib": memory_mib,
            **model,
        }
        for i in range(count)
    ]


def _print_gpus(gpus: list[dict], args: list[str]) -> int:
    query = next((a.split("=", 1)[1] for a in args if a.startswith("--query-gpu=")), None)
    apps = next((a.split("=", 1)[1] for a in args if a.startswith("--query-compute-apps=")), None)
    if apps is not None:
        return _print_apps([f.strip() for f in apps.split(",")], args)
    if "-L" in args or "--list-gpus" in args:
        for g in gpus:
            print(f"GPU {g['index']}: {g['name']} (UUID: {g['uuid']})")
    elif query:
        fields = [f.strip() for f in query.split(",")]
        fmt = _csv_start(fields, QUERY_FIELDS, args)
        if fmt is None:
            return 2
        for g in gpus:
            cells = [QUERY_FIELDS[f](g) for f in fields]
            if "nounits" in fmt:
                cells = [
                    c.removesuffix(" MiB").removesuffix(" %").removesuffix(" MHz") for c in cells
                ]
            print(", ".join(cells))
    else:
        driver = gpus[0]["driver_version"] if gpus else "N/A"
        print(
            f"| NVIDIA-SMI {driver}    Driver Version: {driver}    CUDA Version: {CUDA_VERSION} |"
        )
        for g in gpus:
            print(f"|   {g['index']}  {g['name']}  |  0MiB / {g['memory_mib']}MiB |")
    return 0


def _print_apps(fields: list[str], args: list[str]) -> int:
    """--query-compute-apps: the header (unless noheader), then no process."""
    return 2 if _csv_start(fields, APP_FIELDS, args) is None else 0


def _csv_start(fields: list[str], known, args: list[str]) -> str | None:
    """A query's --format, after its header (unless noheader); None, after nvidia-smi's words,
    when a field is not one it knows."""
    unknown = [f for f in fields if f not in known]
    if unknown:
        print(f'Field "{unknown[0]}" is not a valid field to query.')
        return None
    fmt = next((a.split("=", 1)[1] for a in args if a.startswith("--format=")), "csv")
    if "noheader" not in fmt:
        print(", ".join(fields))
    return fmt


def nvidia_modprobe(root: Path, args: list[str]) -> int:
    """`-u` loads nvidia_uvm and creates its nodes; `-c=N` the GPU node N; `-m` modeset."""
    with host_lock(root):
        state = load_state(root)
        try:
            kernel.load_module(root, state, "nvidia")
            if "-u" in args:
                kernel.create_uvm_nodes(root, state)
            if "-m" in args:
                kernel.load_module(root, state, "nvidia_modeset")
        except kernel.ModuleMissing:
            return 1  # nvidia-modprobe fails silently, as the real one does
        finally:
            save_state(root, state)
    return 0


def modprobe(root: Path, args: list[str]) -> int:
    names = [a.replace("-", "_") for a in args if not a.startswith("-")]
    with host_lock(root):
        return _modprobe(root, names, remove="-r" in args)


def _modprobe(root: Path, names: list[str], *, remove: bool) -> int:
    state = load_state(root)
    for name in names:
        if name not in NVIDIA_MODULES:
            print(
                f"modprobe: FATAL: Module {name} not found in directory /lib/modules/{state.kernel}",
                file=sys.stderr,
            )
            return 1
        if remove:
            print(f"modprobe: FATAL: Module {name} is in use.", file=sys.stderr)
            return 1
        try:
            kernel.load_module(root, state, name)
        except kernel.ModuleMissing as exc:
            print(exc, file=sys.stderr)
            save_state(root, state)
            return 1
    save_state(root, state)
    return 0


def lsmod(root: Path, args: list[str]) -> int:
    print("Module                  Size  Used by")
    for line in (root / "proc/modules").read_text().splitlines():
        name, size, count, users = line.split()[:4]
        print(f"{name:<24}{size:>8}  {count} {users.rstrip(',').replace('-', '')}".rstrip())
    return 0


def pveversion(root: Path, args: list[str]) -> int:
    state = load_state(root)
    manager = f"{state.pve_version}/faa83925c9641325"
    if "-v" not in args and "--verbose" not in args:
        print(f"pve-manager/{manager} (running kernel: {state.kernel})")
        return 0
    release = release_for(state.pve_version)
    major_minor = ".".join(state.pve_version.split(".")[:2])
    print(f"proxmox-ve: {major_minor}.0 (running kernel: {state.kernel})")
    print(f"pve-manager: {state.pve_version} (running version: {manager})")
    for kernel_version in reversed(kernels.installed(root)):
        print(f"proxmox-kernel-{kernel_version}: {kernel_version.removesuffix('-pve')}")
    print(f"lxc-pve: {release.lxc}")
    print(f"pve-container: {release.pve_container}")
    return 0


def ct_userspace(state: SimState, existing: dict | None, host_mounted: bool = False) -> dict:
    """The CT's driver userspace description at start: installed once, kernel view refreshed;
    `host_mounted` (LXC's NVIDIA mount hook): the host's own userspace, at every start."""
    own = (existing or {}).get("userspace_version", state.installed_driver)
    return {
        "node": state.node,
        "gpus": state.gpus,
        "gpu_memory_mib": state.gpu_memory_mib,
        "gpu_name": state.gpu_name,
        "compute_cap": state.compute_cap,
        "userspace_version": state.installed_driver if host_mounted else own,
        "kernel_module_version": state.driver_version if state.module_loaded("nvidia") else None,
    }
