"""The sim's uname, modinfo, dkms and proxmox-boot-tool, over its installed kernels (kernels.py).

Each takes its argv (without the program name) and returns the exit code, printing what the real
tool prints for the uses ddops has:

    uname -r                                   the running kernel (other options: this machine's)
    modinfo [-k VERSION] [-F FIELD] nvidia     "modinfo: ERROR: Module nvidia not found." exit 1
    dkms status                                "nvidia/590.48.01, 7.0.14-8-pve, x86_64: installed"
    dkms autoinstall [-k VERSION]              build + install; exit 11 when a build fails
    proxmox-boot-tool kernel list | pin VERSION [--next-boot] | unpin [--next-boot]; refresh
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ops.sim import kernels
from ops.sim.state import host_lock, load_state, save_state

UNAME = "/usr/bin/uname"
AUTOINSTALL_FAILED = 11  # dkms autoinstall's exit code when a module failed to build


def uname(root: Path, args: list[str]) -> int:
    if args == ["-r"]:
        print(load_state(root).kernel)
        return 0
    os.execv(UNAME, [UNAME, *args])  # the rest of uname is this machine's
    return 1  # not reached


def _option(args: list[str], name: str) -> str | None:
    if name in args and args.index(name) + 1 < len(args):
        return args[args.index(name) + 1]
    return None


def modinfo(root: Path, args: list[str]) -> int:
    kernel = _option(args, "-k") or load_state(root).kernel
    field = _option(args, "-F")
    skip = {i + 1 for i, a in enumerate(args) if a in ("-k", "-F")}
    names = [a for i, a in enumerate(args) if not a.startswith("-") and i not in skip]
    if not names:
        print("modinfo: ERROR: missing module or filename.", file=sys.stderr)
        return 1
    name = names[0].replace("-", "_")
    built = kernels.built_module(root, kernel)
    if built is None or name.replace("_", "-") not in kernels.DKMS_MODULES:
        print(f"modinfo: ERROR: Module {names[0]} not found.", file=sys.stderr)
        return 1
    filename = f"/lib/modules/{kernel}/updates/dkms/{name.replace('_', '-')}.ko"
    fields = {"filename": filename, "version": built["version"], "license": built["license"]}
    fields.update(
        {"description": "NVIDIA kernel module", "vermagic": f"{kernel} SMP preempt mod_unload"}
    )
    if field:
        if field in fields:
            print(fields[field])
        return 0
    for key, value in fields.items():
        print(f"{key + ':':<16}{value}")
    return 0


def dkms(root: Path, args: list[str]) -> int:
    if args[:1] == ["status"]:
        return _dkms_status(root)
    if args[:1] == ["autoinstall"]:
        with host_lock(root):
            state = load_state(root)
            return _autoinstall(root, state, _option(args, "-k") or state.kernel)
    print(f"Error! Unknown action: {' '.join(args[:1]) or '(none)'}", file=sys.stderr)
    return 4


def _dkms_status(root: Path) -> int:
    state = load_state(root)
    driver = state.installed_driver
    if not (root / f"usr/src/{kernels.DKMS_NAME}-{driver}").is_dir():
        return 0
    lines = [
        f"{kernels.DKMS_NAME}/{driver}, {kernel}, x86_64: installed"
        for kernel in kernels.installed(root)
        if (kernels.built_module(root, kernel) or {}).get("version") == driver
    ]
    print("\n".join(lines or [f"{kernels.DKMS_NAME}/{driver}: added"]))
    return 0


def _autoinstall(root: Path, state, kernel: str) -> int:
    if (kernels.built_module(root, kernel) or {}).get("version") == state.installed_driver:
        return 0  # nothing to do: every module is installed for the kernel
    print(
        f"Autoinstall of module {kernels.DKMS_NAME}/{state.installed_driver} for kernel {kernel} (x86_64)"
    )
    if error := kernels.build_module(root, state, kernel):
        print(error, file=sys.stderr)
        print(
            f"\nAutoinstall on {kernel} failed for module(s) {kernels.DKMS_NAME}"
            f"({AUTOINSTALL_FAILED}).\nError! One or more modules failed to install during "
            "autoinstall.\nRefer to previous errors for more information.",
            file=sys.stderr,
        )
        return AUTOINSTALL_FAILED
    print(f"Building module(s)... done.\nInstalling to /lib/modules/{kernel}/updates/dkms/")
    print(f"\nAutoinstall on {kernel} succeeded for module(s) {kernels.DKMS_NAME}.")
    save_state(root, state)
    return 0


def proxmox_boot_tool(root: Path, args: list[str]) -> int:
    if args != ["refresh"] and (args[:1] not in (["kernel"], ["kernels"]) or len(args) < 2):
        print(f"Invalid/unknown command '{' '.join(args[:1])}'.", file=sys.stderr)
        return 1
    if args == ["refresh"]:
        print(
            "Running hook script 'proxmox-auto-removal'..\nRunning hook script 'zz-proxmox-boot'.."
        )
        print("No /etc/kernel/proxmox-boot-uuids found, skipping ESP sync.")
        return 0
    command, rest = args[1], args[2:]
    if command == "list":
        return _list(root)
    if command == "pin" and rest and rest[1:] in ([], ["--next-boot"]):
        return _pin(root, rest[0], next_boot=rest[1:] == ["--next-boot"])
    if command == "unpin" and rest in ([], ["--next-boot"]):
        return _unpin(root, next_boot=bool(rest))
    print(f"E: invalid 'kernel' subcommand '{command}'.", file=sys.stderr)
    return 1


def _list(root: Path) -> int:
    print("Manually selected kernels:\nNone.\n\nAutomatically selected kernels:")
    print("\n".join(reversed(kernels.installed(root))))
    for title, pin in (
        ("Pinned kernel", kernels.PIN_FILE),
        ("Kernel pinned on next-boot", kernels.NEXT_BOOT_PIN_FILE),
    ):
        if kernel := kernels.first_line(root / pin):
            print(f"\n{title}:\n{kernel}")
    return 0


def _pin(root: Path, kernel: str, *, next_boot: bool) -> int:
    if kernel not in kernels.installed(root):
        print(
            f"E: no kernel image found in /boot for '{kernel}', not setting default.\n\n"
            "Possible Proxmox kernel versions are:\n" + "\n".join(kernels.installed(root)),
            file=sys.stderr,
        )
        return 1
    name = kernels.NEXT_BOOT_PIN_FILE if next_boot else kernels.PIN_FILE
    path = root / name
    old = kernels.first_line(path)
    if old and old != kernel:
        print(f"Overriding previously pinned version '{old}' with '{kernel}'")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(kernel + "\n")
    print(f"Set kernel '{kernel}' in /{name}. Use the 'refresh' command to update the ESPs.")
    if next_boot:
        print("Pinned for next boot only.")
    return 0


def _unpin(root: Path, *, next_boot: bool) -> int:
    names = [kernels.NEXT_BOOT_PIN_FILE] + ([] if next_boot else [kernels.PIN_FILE])
    for name in names:
        (root / name).unlink(missing_ok=True)
        print(f"Removed /{name}.")
    return 0
