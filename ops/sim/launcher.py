"""Writes the sim's executables: tiny scripts that call `ops.sim.commands.main` with this Python."""

from __future__ import annotations

import os
import sys
from pathlib import Path


def write_launcher(path: Path, tool: str, root: Path, *, in_ct: bool = False) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    python = os.path.realpath(sys.executable)
    path.write_text(
        f"#!{python}\n"
        f'"""The ddops sim\'s {tool} for the simulated host {root}."""\n'
        "from ops.sim.commands import main\n\n"
        f"raise SystemExit(main({tool!r}, root={str(root)!r}, in_ct={in_ct!r}))\n"
    )
    path.chmod(0o755)
