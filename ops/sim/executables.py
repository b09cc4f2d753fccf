"""Entry point of the sim's executables (pct, nvidia-smi, ...) and the launchers that call it.

A launcher is a tiny script in PATH/usr/sbin or PATH/usr/bin (or a CT's /bin):

    #!/path/to/python
    from ops.sim.executables import main
    raise SystemExit(main("pct", root="/tmp/pve1"))

so `pct ...` run through `LocalTransport(sysroot=PATH)`, or over SSH to loopback, reaches the sim.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

from ops.sim.launcher import write_launcher
from ops.sim.processct import CT_ROOT_ENV
from ops.sim.state import BIN_DIR, SBIN_DIR

# tool -> (its directory on the host, "module:function" run for it). Each call imports only its
# own module: every ddops command on a sim host starts several of these processes.
HOST_TOOLS = {
    "pct": (SBIN_DIR, "pct:main"),
    "pveversion": (SBIN_DIR, "nvidia:pveversion"),
    "modprobe": (SBIN_DIR, "nvidia:modprobe"),
    "lsmod": (SBIN_DIR, "nvidia:lsmod"),
    "nvidia-smi": (BIN_DIR, "nvidia:nvidia_smi_host"),
    "nvidia-modprobe": (BIN_DIR, "nvidia:nvidia_modprobe"),
    "uname": (BIN_DIR, "kerneltools:uname"),
    "lspci": (BIN_DIR, "nvidia:lspci"),
    "modinfo": (SBIN_DIR, "kerneltools:modinfo"),
    "dkms": (SBIN_DIR, "kerneltools:dkms"),
    "proxmox-boot-tool": (SBIN_DIR, "kerneltools:proxmox_boot_tool"),
}


def _function(spec: str):
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(f"ops.sim.{module}"), name)


def main(tool: str, root: str, in_ct: bool = False, argv: list[str] | None = None) -> int:
    """Run sim tool `tool` for the sim host at `root` with `argv` (default: sys.argv[1:])."""
    args = sys.argv[1:] if argv is None else argv
    if in_ct:  # inside a real CT the root is "/"; a process-mode CT says where its root is
        return _function("nvidia:nvidia_smi_ct")(Path(os.environ.get(CT_ROOT_ENV, "/")), args)
    return _function(HOST_TOOLS[tool][1])(Path(root), args)


def install_host_tools(root: Path) -> None:
    for tool, (bin_dir, _) in HOST_TOOLS.items():
        write_launcher(root / bin_dir / tool, tool, root)
