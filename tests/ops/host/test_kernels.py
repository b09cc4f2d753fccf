"""The host's kernels: `proxmox-boot-tool kernel list`, `modinfo`, the next boot, ddops' pin record.

python -m pytest -q tests/ops/host/test_kernels.py
"""

from __future__ import annotations

from ops.host.kernels import (
    BootSelection,
    KernelFacts,
    ModuleBuild,
    PinRecord,
    parse_kernel_list,
    parse_modinfo,
    parse_pin_record,
    pin_record_text,
    version_key,
)
from ops.host.transport import Result

# As proxmox-boot-tool prints it (manual list empty, both pins set).
KERNEL_LIST = """\
Manually selected kernels:
None.

Automatically selected kernels:
6.17.13-4-pve
7.0.14-10-pve
7.0.14-9-pve

Pinned kernel:
6.17.13-4-pve

Kernel pinned on next-boot:
7.0.14-9-pve
"""
MODINFO_OPEN = """\
filename:       /lib/modules/7.0.14-8-pve/updates/dkms/nvidia.ko
alias:          char-major-195-*
version:        590.48.01
supported:      external
license:        Dual MIT/GPL
"""


def test_kernel_list_pins_and_where_the_next_boot_goes():
    selection = parse_kernel_list(KERNEL_LIST)
    assert selection == BootSelection(
        (), ("6.17.13-4-pve", "7.0.14-10-pve", "7.0.14-9-pve"), "6.17.13-4-pve", "7.0.14-9-pve"
    )
    assert selection.kernels == ["6.17.13-4-pve", "7.0.14-9-pve", "7.0.14-10-pve"]  # by version
    assert selection.next_boot == "7.0.14-9-pve"  # the next-boot pin wins, then the pin
    no_next = parse_kernel_list(KERNEL_LIST.split("\nKernel pinned")[0])
    assert no_next.next_boot == "6.17.13-4-pve"
    unpinned = parse_kernel_list(KERNEL_LIST.split("\nPinned kernel:")[0])
    assert (unpinned.pinned, unpinned.next_boot) == (None, "7.0.14-10-pve")  # the newest
    assert version_key("7.0.14-10-pve") > version_key("7.0.14-9-pve")


def test_modinfo_names_the_version_and_the_open_flavour():
    assert parse_modinfo(MODINFO_OPEN) == ModuleBuild("590.48.01", open=True)
    proprietary = MODINFO_OPEN.replace("Dual MIT/GPL", "NVIDIA").replace("590.48.01", "550.90.07")
    assert parse_modinfo(proprietary) == ModuleBuild("550.90.07", open=False)
    assert parse_modinfo("") is None


class ScriptedHost:
    """Answers modinfo and dkms as a host would; counts the calls."""

    def __init__(self, modules: dict[str, str | None], dkms: str) -> None:
        self.modules, self.dkms, self.calls = modules, dkms, []

    def run(self, argv, **_):
        self.calls.append(tuple(argv))
        if argv[0] == "dkms":
            return Result(tuple(argv), 0, self.dkms + "\n", "")
        version = self.modules[argv[2]]
        found = MODINFO_OPEN.replace("590.48.01", version) if version else ""
        return Result(tuple(argv), 0 if version else 1, found, "" if version else "not found")


def test_one_line_says_what_runs_what_dkms_says_and_which_kernels_have_the_module():
    host = ScriptedHost(
        {"6.17.13-4-pve": "590.48.01", "7.0.14-9-pve": None, "7.0.14-10-pve": "590.48.01"},
        "nvidia/590.48.01, 6.17.13-4-pve, x86_64: installed",
    )
    facts = KernelFacts(
        host, "7.0.14-9-pve", parse_kernel_list(KERNEL_LIST.split("\nPinned kernel:")[0])
    )
    assert not facts.without_module(facts.next_boot) and len(host.calls) == 1  # read when asked
    assert facts.one_line() == (
        "running kernel 7.0.14-9-pve has no nvidia module (driver 590.48.01; dkms status: "
        "nvidia/590.48.01, 6.17.13-4-pve, x86_64: installed; installed kernels with the module: "
        "6.17.13-4-pve, 7.0.14-10-pve)"
    )
    assert facts.previous_with_module() == "7.0.14-10-pve"
    assert facts.without_module("7.0.14-9-pve") and not facts.without_module("7.0.14-10-pve")
    assert len(host.calls) == 4  # each kernel's modinfo once, dkms once


def test_pin_record_round_trips_and_a_partial_one_is_none():
    record = PinRecord("7.0.14-8-pve", "7.0.14-9-pve", "2026-12-02T03:49:51Z")
    assert parse_pin_record(pin_record_text(record)) == record
    assert parse_pin_record("pinned=7.0.14-8-pve\n") is None
