"""Fault injection for tests: break a simulated host the ways real hosts break.

    from ops.sim import faults
    faults.lock_ct(root, 200, "backup")               # pct start/stop now fail "CT is locked (backup)"
    faults.set_ct_driver_version(root, 200, "550.54.14")  # userspace != module: version mismatch
    faults.truncate_ct_file(root, 200, "/dev/shm/model/model.safetensors", 100)
    faults.kill_ct_process(root, 200, pid)            # a process inside CT 200 dies (SIGKILL)
    faults.remove_host_node(root, "nvidia-uvm")       # a /dev node vanishes on the host
    faults.unload_module(root, "nvidia_uvm")
    faults.remove_kernel_module(root, "7.0.14-8-pve")  # its nvidia.ko gone (DKMS can rebuild it)

Each acts on the sim's files and containers directly, as the fault itself would, not through ddops.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

from ops.sim import kernel, kernels, pveconf
from ops.sim.nvidia import CT_USERSPACE_FILE
from ops.sim.pct import Pct, PctError
from ops.sim.state import host_lock, save_state


def lock_ct(root: Path, vmid: int, lock: str = "backup") -> None:
    pct = Pct(root)
    pct.conf_path(vmid).write_text(pveconf.set_keys(pct.conf(vmid), {"lock": lock}))


def set_ct_driver_version(root: Path, vmid: int, version: str) -> None:
    """The CT's driver userspace becomes `version` (as after an apt upgrade inside the CT)."""
    described = Pct(root).cts.rootfs(vmid) / CT_USERSPACE_FILE
    userspace = json.loads(described.read_text())
    userspace["userspace_version"] = version
    described.write_text(json.dumps(userspace) + "\n")


def _exec_in_ct(root: Path, vmid: int, argv: list[str]) -> None:
    rc = Pct(root).exec(vmid, argv)
    if rc != 0:
        raise PctError(f"CT {vmid}: {argv[0]} exited {rc}")


def truncate_ct_file(root: Path, vmid: int, path: str, size: int) -> None:
    """Cut a file inside the running CT (e.g. in its /dev/shm tmpfs) to `size` bytes."""
    _exec_in_ct(root, vmid, ["truncate", "-s", str(size), path])


def kill_ct_process(root: Path, vmid: int, pid: int, sig: int = signal.SIGKILL) -> None:
    """Send `sig` to process `pid` as the CT sees it."""
    _exec_in_ct(root, vmid, ["kill", f"-{int(sig)}", str(pid)])


def remove_host_node(root: Path, name: str) -> None:
    (root / "dev" / name).unlink()


def unload_module(root: Path, name: str) -> None:
    """Unload `name` and the modules using it (their /proc entries go; nodes stay, as on a host)."""
    with host_lock(root):
        pct = Pct(root)
        state = pct.state
        gone = {name}
        while (
            users := {m for m in state.modules if gone & set(kernel.MODULE_DEPS.get(m, []))} - gone
        ):
            gone |= users
        state.modules = [m for m in state.modules if m not in gone]
        kernel.write_proc(root, state)
        save_state(root, state)


def remove_kernel_module(root: Path, kernel: str) -> None:
    """The NVIDIA modules gone from `kernel`'s modules directory (DKMS sources and headers stay:
    `dkms autoinstall -k KERNEL` builds them again)."""
    kernels.remove_module(root, kernel)
