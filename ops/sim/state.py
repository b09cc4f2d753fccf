"""The simulated host's own state: one JSON file below the sim root, plus its fixed layout.

A sim root PATH mirrors a Proxmox VE host (PATH/etc/pve/lxc, PATH/proc, PATH/dev, PATH/usr/sbin);
what a real host keeps in its kernel (loaded modules, the uvm major, the driver version) lives
in PATH/var/lib/ddops-sim/state.json. Only the sim reads and writes this file.
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ops.errors import DdopsError
from ops.sim.release import DEFAULT_PVE_VERSION, release_for

STATE_FILE = "var/lib/ddops-sim/state.json"
LOG_FILE = "var/log/ddops-sim.log"
LOCK_HELD_ENV = "DDOPS_SIM_LOCK_HELD"
LXC_PATH = "var/lib/lxc"
CT_CONF_DIR = "etc/pve/lxc"
ROOTFS_DIR = "var/lib/ddops-sim/rootfs"
BIN_DIR = "usr/bin"
SBIN_DIR = "usr/sbin"

_DEFAULT = release_for(DEFAULT_PVE_VERSION)
# The nvidia modules a host loads, in dependency order.
NVIDIA_MODULES = ("nvidia", "nvidia_modeset", "nvidia_uvm", "nvidia_drm")


def default_extra_binds() -> list[str]:
    """Host dirs bound read-only into every real container: the Python prefix and this project."""
    project = str(Path(__file__).resolve().parents[2])
    prefixes = {os.path.realpath(sys.base_prefix), os.path.realpath(sys.prefix), project}
    return sorted(prefixes)


@dataclass
class SimState:
    """What the simulated kernel and driver look like now."""

    node: str = "pve"
    pve_version: str = DEFAULT_PVE_VERSION
    kernel: str = (
        _DEFAULT.kernel
    )  # the running kernel (`uname -r`); ops/sim/kernels.py: the installed
    driver_version: str = _DEFAULT.driver  # the loaded nvidia module's version
    installed_driver: str = _DEFAULT.driver  # the driver package: host userspace + DKMS sources
    open_module: bool = True  # the installed driver's module flavour: open or proprietary
    dkms_broken: list[str] = field(default_factory=list)  # kernels the driver's DKMS build fails on
    gpu_name: str = _DEFAULT.gpu_name
    compute_cap: str = _DEFAULT.compute_cap
    gpus: int = 1
    gpu_memory_mib: int = 97887  # each GPU's memory.total, as nvidia-smi reports it (96 GB card)
    uvm_major: int = 511
    caps_major: int = 510
    modules: list[str] = field(default_factory=list)
    containers: str = "lxc"  # "lxc": real LXC containers; "process": plain processes
    device_nodes: str = "mknod"  # "mknod": real character nodes; "file": placeholders (non-root)
    extra_binds: list[str] = field(default_factory=default_extra_binds)
    ct_path: str = ""  # PATH inside containers (`pct exec`); empty = default_ct_path()
    running: list[int] = field(default_factory=list)  # process mode only: CTs "running"
    boots: int = 1
    hub_port: int = 0  # the host's own hub (ops/sim/hubservice.py) on 127.0.0.1; 0: none yet
    sim: int = 1

    def module_loaded(self, name: str) -> bool:
        return name in self.modules

    def effective_ct_path(self) -> str:
        return self.ct_path or default_ct_path()


def default_ct_path() -> str:
    """The PATH `pct exec` gives a command: this Python's bin dir first, then the usual dirs."""
    python_bin = os.path.dirname(os.path.realpath(sys.executable))
    return f"{python_bin}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def is_sim_root(root: Path) -> bool:
    return (root / STATE_FILE).is_file()


def load_state(root: Path) -> SimState:
    """The state of the sim at `root`; DdopsError when `root` is not a sim host."""
    path = root / STATE_FILE
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise DdopsError(
            str(root), "not a simulated host (no var/lib/ddops-sim/state.json)"
        ) from None
    known = {k: v for k, v in data.items() if k in SimState.__dataclass_fields__}
    return SimState(**known)


def save_state(root: Path, state: SimState) -> None:
    path = root / STATE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(state), indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def log(root: Path, message: str) -> None:
    """Append one line, its time first, to the sim's log (what a real host would put in its
    journal): where a reboot's seconds went can be read from it."""
    path = root / LOG_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%H:%M:%S", time.localtime()) + f".{int(time.time() * 1000) % 1000:03d}"
    with path.open("a") as f:
        f.write(f"{stamp} {message.rstrip()}\n")


@contextmanager
def host_lock(root: Path):
    """Serialise state changes on one sim host (pct, nvidia-modprobe, reboot): one lock file.

    A process the lock holder starts (a hookscript calling nvidia-modprobe) inherits the lock
    through LOCK_HELD_ENV instead of waiting for its own parent."""
    if os.environ.get(LOCK_HELD_ENV) == str(root):
        yield
        return
    path = root / "var/lib/ddops-sim/lock"
    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def lock_inheriting_env(root: Path, env: dict[str, str]) -> dict[str, str]:
    """`env` for a child of the lock holder (see host_lock)."""
    return {**env, LOCK_HELD_ENV: str(root)}
