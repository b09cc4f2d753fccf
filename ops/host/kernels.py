"""The host's kernels and the NVIDIA module built for each, read through a Transport.

    facts = kernel_facts(t)
    facts.running, facts.next_boot        # `uname -r`; what `proxmox-boot-tool kernel list` boots
    facts.module("7.0.14-8-pve")          # ModuleBuild("590.48.01", open=True), or None: no module
    facts.without_module(facts.next_boot) # True: a reboot now boots a kernel without nvidia
    facts.one_line()                      # running kernel, driver, dkms status, which kernels have it

Where the next boot goes, as proxmox-boot-tool decides it: the next-boot pin, else the pin, else
the newest kept kernel. The module of a kernel is what `modinfo -k VERSION nvidia` finds (a DKMS
build, the .run installer's, a distribution package's alike). Parsers are pure functions of the
commands' text (tests/ops/host/test_kernels.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ops.errors import DdopsError
from ops.host.transport import Transport

OPEN_LICENSE = "Dual MIT/GPL"  # the open kernel module's license (the proprietary one: "NVIDIA")
_SECTIONS = {
    "Manually selected kernels:": "manual",
    "Automatically selected kernels:": "automatic",
    "Pinned kernel:": "pinned",
    "Kernel pinned on next-boot:": "next_boot",
}
_KERNEL = re.compile(r"\d+\.\d+[\w.+~-]*")


def version_key(kernel: str) -> tuple[int, ...]:
    """Sort key of a kernel version: "6.17.13-4-pve" < "7.0.14-8-pve" < "7.0.14-10-pve"."""
    return tuple(int(n) for n in re.findall(r"\d+", kernel))


@dataclass(frozen=True)
class BootSelection:
    """`proxmox-boot-tool kernel list`: the kept kernels and the pins."""

    manual: tuple[str, ...] = ()
    automatic: tuple[str, ...] = ()
    pinned: str | None = None
    next_boot_pin: str | None = None

    @property
    def kernels(self) -> list[str]:
        """Every kept kernel, oldest first."""
        return sorted({*self.manual, *self.automatic}, key=version_key)

    @property
    def unpinned(self) -> str | None:
        """The kernel a boot without any pin runs: the newest kept."""
        return self.kernels[-1] if self.kernels else None

    @property
    def next_boot(self) -> str | None:
        return self.next_boot_pin or self.pinned or self.unpinned


def parse_kernel_list(text: str) -> BootSelection:
    """Parse `proxmox-boot-tool kernel list` ("None." lines and unknown lines are skipped)."""
    found: dict[str, list[str]] = {name: [] for name in _SECTIONS.values()}
    section = None
    for line in text.splitlines():
        line = line.strip()
        if line in _SECTIONS:
            section = _SECTIONS[line]
        elif section and _KERNEL.fullmatch(line):
            found[section].append(line)
    return BootSelection(
        tuple(found["manual"]),
        tuple(found["automatic"]),
        (found["pinned"] or [None])[0],
        (found["next_boot"] or [None])[0],
    )


@dataclass(frozen=True)
class ModuleBuild:
    """The nvidia module installed for one kernel: its version and whether it is the open one."""

    version: str
    open: bool


def parse_modinfo(text: str) -> ModuleBuild | None:
    """`modinfo -k VERSION nvidia` ("version:  590.48.01", "license:  Dual MIT/GPL")."""
    fields = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    if not fields.get("version"):
        return None
    return ModuleBuild(fields["version"], fields.get("license") == OPEN_LICENSE)


class KernelFacts:
    """The running kernel and the boot selection, read at once; each kernel's module and
    `dkms status` read when first asked for (the common case needs the next boot's only)."""

    def __init__(self, t: Transport, running: str, selection: BootSelection) -> None:
        self.t, self.running, self.selection = t, running, selection
        self._modules: dict[str, ModuleBuild | None] = {}
        self._dkms: str | None = None

    @property
    def next_boot(self) -> str:
        return self.selection.next_boot or self.running

    @property
    def installed(self) -> list[str]:
        return sorted({*self.selection.kernels, self.running}, key=version_key)

    def module(self, kernel: str) -> ModuleBuild | None:
        if kernel not in self._modules:
            self._modules[kernel] = module_build(self.t, kernel)
        return self._modules[kernel]

    @property
    def dkms(self) -> str:
        if self._dkms is None:
            self._dkms = dkms_status(self.t)
        return self._dkms

    def without_module(self, kernel: str) -> bool:
        return self.module(kernel) is None

    def with_module(self) -> list[str]:
        return [k for k in self.installed if not self.without_module(k)]

    def previous_with_module(self) -> str | None:
        """The newest installed kernel other than the running one that has the module."""
        others = [k for k in self.with_module() if k != self.running]
        return others[-1] if others else None

    def driver(self) -> str | None:
        """The driver version the kernels' modules (or DKMS) name, newest kernel's first."""
        for kernel in reversed(self.with_module()):
            return self.module(kernel).version
        match = re.search(r"nvidia/(\d+(?:\.\d+)+)", self.dkms)
        return match[1] if match else None

    def one_line(self) -> str:
        """Running kernel, driver, dkms status and which installed kernels have the module."""
        have = ", ".join(self.with_module()) or "none"
        return (
            f"running kernel {self.running} has no nvidia module (driver {self.driver() or '?'}; "
            f"dkms status: {self.dkms or 'nothing'}; installed kernels with the module: {have})"
        )


def running_kernel(t: Transport) -> str:
    return t.run(["uname", "-r"]).check(t.label).stdout.strip()


def boot_selection(t: Transport) -> BootSelection:
    r = t.run(["proxmox-boot-tool", "kernel", "list"])
    if r.rc == 127:
        raise DdopsError(t.label, "no proxmox-boot-tool: cannot tell which kernel boots next")
    return parse_kernel_list(r.check(t.label).stdout)


def module_build(t: Transport, kernel: str) -> ModuleBuild | None:
    """The nvidia module `kernel` has installed (None: modinfo finds none)."""
    r = t.run(["modinfo", "-k", kernel, "nvidia"])
    return parse_modinfo(r.stdout) if r.ok else None


def dkms_status(t: Transport) -> str:
    r = t.run(["dkms", "status"])
    return "; ".join(line.strip() for line in r.stdout.splitlines() if line.strip()) if r.ok else ""


def kernel_facts(t: Transport) -> KernelFacts:
    return KernelFacts(t, running_kernel(t), boot_selection(t))


# -- the pin ddops' kernel hook (or recover) set -----------------------------------------------
# /etc/kernel/postinst.d/zz-ddops-nvidia (templates/ddops-kernel-hook.sh.j2) pins the running
# kernel when a new one got no nvidia module, and says so here, so that health can tell the pin
# is ddops' and recover lifts it (only then) once the kernel the host would boot has the module.
PIN_RECORD = "/var/lib/ddops/kernel-pin"


@dataclass(frozen=True)
class PinRecord:
    """ddops pinned `pinned` on `when` because `new` got no nvidia module."""

    pinned: str
    new: str
    when: str


def parse_pin_record(text: str) -> PinRecord | None:
    """The record's `key=value` lines; None when `pinned` or `new` is missing."""
    fields = dict(line.split("=", 1) for line in text.splitlines() if "=" in line)
    if not fields.get("pinned") or not fields.get("new"):
        return None
    return PinRecord(fields["pinned"], fields["new"], fields.get("when", "?"))


def pin_record_text(record: PinRecord) -> str:
    return (
        "# ddops pinned this kernel: a newer one got no nvidia module (ddops health shows it)\n"
        f"pinned={record.pinned}\nnew={record.new}\nwhen={record.when}\n"
    )


def read_pin_record(t: Transport) -> PinRecord | None:
    return parse_pin_record(t.read_text(PIN_RECORD)) if t.exists(PIN_RECORD) else None
