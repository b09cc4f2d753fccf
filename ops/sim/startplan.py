"""What `pct start` derives from /etc/pve/lxc/<vmid>.conf before a container runs, as Proxmox does.

- `devN: /dev/X[,mode=..,uid=..,gid=..]`: the host node is stat'ed now (below the sim root);
  its *current* major:minor is granted and the node is made for the CT (mode 0660 unless given,
  owner uid:gid inside the CT, both 0 unless given: Proxmox's passthrough defaults). A missing
  node fails the start loudly.
- `unprivileged: 1`: the CT's root is not the host's (ids 0..65535 mapped to 100000.., as
  Proxmox maps them).
- `lxc.cgroup2.devices.allow|deny` lines are kept as device rules (the backend spells them
  for the machine's cgroup version).
- `lxc.mount.entry` lines keep their options; an absolute source path is a host path, so it
  maps below the sim root (`optional` + missing source = silently absent, like real LXC).
- `lxc.hook.mount: /usr/share/lxc/hooks/nvidia` (+ its `lxc.environment` lines) is pct's: the
  host's own driver userspace is the CT's (ops/sim/pct.py).
- Other raw `lxc.*` keys are not applied by the sim; they are named in `ignored`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from ops.sim import pveconf
from ops.sim.kernel import node_numbers

DEVICE_RULE_KEYS = ("lxc.cgroup2.devices.allow", "lxc.cgroup2.devices.deny")
# LXC's NVIDIA mount hook and its variables: pct's start honours them (the CT's userspace)
HONOURED_ELSEWHERE = ("lxc.hook.mount", "lxc.environment")
SHM_TARGET = "dev/shm"
PASSTHROUGH_MODE = 0o660  # what Proxmox gives a devN node without mode=


class StartError(Exception):
    """The CT cannot start; the message is what Proxmox prints."""


@dataclass(frozen=True)
class CtDevice:
    """A node to create in the CT's /dev, with the numbers the host node has now."""

    name: str  # path below /dev, e.g. "nvidia-uvm"
    major: int
    minor: int
    mode: int
    uid: int
    gid: int


@dataclass
class StartPlan:
    hostname: str
    devices: list[CtDevice] = field(default_factory=list)
    rules: list[tuple[str, str]] = field(default_factory=list)  # ("allow"|"deny", "c 195:* rwm")
    mounts: list[str] = field(default_factory=list)  # LXC mount entries, host paths mapped
    ignored: list[str] = field(default_factory=list)
    unprivileged: bool = False

    @property
    def has_shm_mount(self) -> bool:
        return any(entry.split()[1:2] == [SHM_TARGET] for entry in self.mounts)


def plan_start(vmid: int, conf_text: str, sim_root: Path) -> StartPlan:
    """The plan for starting CT `vmid`; StartError when a devN node is missing."""
    settings = pveconf.values(conf_text)
    plan = StartPlan(
        hostname=settings.get("hostname", f"CT{vmid}"),
        unprivileged=settings.get("unprivileged") == "1",
    )
    for dev in pveconf.dev_entries(conf_text):
        plan.devices.append(resolve_dev(dev, sim_root))
        major, minor = plan.devices[-1].major, plan.devices[-1].minor
        plan.rules.append(("allow", f"c {major}:{minor} rwm"))
    for key, value in pveconf.entries(conf_text):
        if key in DEVICE_RULE_KEYS:
            plan.rules.append((key.rsplit(".", 1)[1], value))
        elif key == "lxc.mount.entry":
            plan.mounts.append(map_mount_source(value, sim_root))
        elif key.startswith("lxc.") and key not in HONOURED_ELSEWHERE:
            plan.ignored.append(f"{key}: {value}")
    return plan


def resolve_dev(dev: pveconf.DevEntry, sim_root: Path) -> CtDevice:
    host_node = sim_root / dev.path.lstrip("/")
    numbers = node_numbers(host_node)
    if numbers is None or not dev.path.startswith("/dev/"):
        raise StartError(f"Could not get mode or device ID of {dev.path}")
    return CtDevice(
        name=dev.path.removeprefix("/dev/"),
        major=numbers[0],
        minor=numbers[1],
        mode=dev.mode if dev.mode is not None else PASSTHROUGH_MODE,
        uid=dev.uid or 0,
        gid=dev.gid or 0,
    )


def map_mount_source(entry: str, sim_root: Path) -> str:
    """An LXC mount entry with an absolute source path moved below the sim root."""
    source, *rest = entry.split()
    if os.path.isabs(source):
        source = str(sim_root / source.lstrip("/"))
    return " ".join([source, *rest])


def mount_options(entry: str) -> set[str]:
    fields = entry.split()
    return set(fields[3].split(",")) if len(fields) > 3 else set()
