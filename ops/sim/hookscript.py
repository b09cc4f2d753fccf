"""A CT's `hookscript:` as Proxmox runs it around `pct start`: `<script> <vmid> <phase>`.

`hookscript: local:snippets/x.sh` names PATH/var/lib/vz/snippets/x.sh on the sim host (only the
`local` directory storage exists here). pre-start runs before the devN entries are resolved
(so it may create nodes) and a non-zero exit aborts the start; post-start's exit is ignored.
The script runs on this machine with the sim host's bin dirs first on PATH and SIM_ROOT set,
so tools called by name (`nvidia-modprobe -u -c=0`) are the sim's; an absolute path names this
machine's file, as it would on a real host.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from ops.sim.state import lock_inheriting_env

STORAGE_DIRS = {"local": "var/lib/vz"}


class HookError(Exception):
    """The hookscript is missing or failed in pre-start; the message is Proxmox's."""


def script_path(root: Path, volume: str) -> Path:
    storage, _, name = volume.partition(":")
    if storage not in STORAGE_DIRS or not name.startswith("snippets/"):
        raise HookError(f"hookscript: volume '{volume}' is not a snippet on a directory storage")
    path = root / STORAGE_DIRS[storage] / name
    if not path.is_file():
        raise HookError(f"hookscript: file '{path.relative_to(root).as_posix()}' does not exist")
    return path


def run_hook(root: Path, volume: str, vmid: int, phase: str) -> None:
    """Run one phase; HookError when pre-start fails (other phases' failures are ignored)."""
    script = script_path(root, volume)
    env = lock_inheriting_env(root, dict(os.environ, SIM_ROOT=str(root)))
    env["PATH"] = f"{root / 'usr/sbin'}:{root / 'usr/bin'}:{env.get('PATH', '')}"
    proc = subprocess.run([str(script), str(vmid), phase], env=env, capture_output=True, text=True)
    if proc.returncode != 0 and phase == "pre-start":
        command = f"/{script.relative_to(root).as_posix()} {vmid} {phase}"
        raise HookError(
            f"hookscript error for {vmid} on {phase}: command '{command}' failed: "
            f"exit code {proc.returncode}"
        )
