"""What a Proxmox VE release ships, as the sim plays it: kernel, LXC, pve-container, default GPU.

    release_for("9.2.11")   # Release(kernel="7.0.14-8-pve", lxc="6.0.5-1", ...)
    parse_pve_version("9.x")  # ValueError: the one line `ddops sim init` prints

PVE 9 (Debian 13) is the current platform: 9.0 boots kernel 6.14, 9.1 kernel 6.17, 9.2 kernel 7.0;
LXC 6.0.x, cgroup v2 only, `pct create` unprivileged by default (pve-container 6.0.6), devN
hot-plug into a running CT (pve-container 6.0.4). PVE 8 (end of life 2026-08-31) and older keep
the sim's earlier host: kernel 6.8.12-1-pve, privileged by default, driver 550.90.07 (the
proprietary module) on an Ada card. The sim's default host is the newest release here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

BLACKWELL = "NVIDIA RTX PRO 6000 Blackwell Workstation Edition"
ADA = "NVIDIA RTX 6000 Ada Generation"
DEV_HOTPLUG_FROM = (6, 0, 4)  # pve-container attaches a new devN entry to a running CT
OPEN_MODULE_DEFAULT_FROM = 560  # NVIDIA's installers default to the open kernel module from 560


@dataclass(frozen=True)
class Release:
    """One Proxmox VE release line (major.minor) as the sim installs it."""

    kernel: str  # the -pve kernel a fresh install of the release boots
    lxc: str  # lxc-pve package version
    pve_container: str
    driver: str  # the NVIDIA driver the sim's host has by default
    gpu_name: str
    compute_cap: str
    unprivileged_default: bool  # what `pct create` does without --unprivileged
    container_toolkit: bool  # the sim's host has libnvidia-container (LXC's NVIDIA hook works)

    @property
    def hotplugs_dev_entries(self) -> bool:
        """Whether `pct set -devN` attaches the node to a running CT (pve-container >= 6.0.4)."""
        parts = tuple(int(p) for p in re.findall(r"\d+", self.pve_container)[:3])
        return parts >= DEV_HOTPLUG_FROM


RELEASES = {
    (9, 2): Release("7.0.14-8-pve", "6.0.5-1", "6.0.6", "590.48.01", BLACKWELL, "12.0", True, True),
    (9, 1): Release(
        "6.17.13-4-pve", "6.0.5-1", "6.0.6", "590.48.01", BLACKWELL, "12.0", True, True
    ),
    (9, 0): Release(
        "6.14.11-4-pve", "6.0.4-2", "6.0.6", "580.105.08", BLACKWELL, "12.0", True, True
    ),
    (8, 0): Release("6.8.12-1-pve", "6.0.0-1", "5.1.12", "550.90.07", ADA, "8.9", False, False),
    (7, 0): Release("5.15.158-2-pve", "5.0.2-4", "4.4-6", "550.90.07", ADA, "8.9", False, False),
}
DEFAULT_PVE_VERSION = "9.2.11"
_VERSION = re.compile(r"(\d+)\.(\d+)\.(\d+)")


def parse_pve_version(text: str) -> tuple[int, int, int]:
    """(major, minor, patch) of a pve-manager version "9.2.11"; ValueError in words otherwise."""
    match = _VERSION.fullmatch(text.strip())
    if not match:
        raise ValueError(f"--pve-version {text!r}: expected MAJOR.MINOR.PATCH, e.g. 9.2.11")
    version = tuple(int(part) for part in match.groups())
    if not 7 <= version[0] <= 9:
        raise ValueError(f"--pve-version {text}: the sim plays Proxmox VE 7, 8 and 9")
    return version  # type: ignore[return-value]


def release_for(pve_version: str) -> Release:
    """The release line of `pve_version` (the nearest one at or below it)."""
    major, minor, _ = parse_pve_version(pve_version)
    known = sorted(key for key in RELEASES if key <= (major, minor))
    return RELEASES[known[-1]]


def open_module_default(driver: str) -> bool:
    """Whether NVIDIA's installer builds the open kernel module for `driver` by default."""
    return int(driver.split(".")[0]) >= OPEN_MODULE_DEFAULT_FROM
