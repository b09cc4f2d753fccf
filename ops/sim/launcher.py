"""Writes the sim's executables: tiny scripts that call `ops.sim.executables.main` with this Python.

A launcher runs this interpreter (a venv's stays a venv's: no realpath) without its site
packages (`-S`: the tools are stdlib only, and each call is a process start) and imports ops from
the directory this very ops was loaded from, so it runs the same code inside a container (where
that directory and the Python prefixes are bound read-only) whether ddops is installed
editable, as a wheel, or not at all.
"""

from __future__ import annotations

import sys
from pathlib import Path


def write_launcher(path: Path, tool: str, root: Path, *, in_ct: bool = False) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    code_dir = str(Path(__file__).resolve().parents[2])  # holds the ops package
    path.write_text(
        f"#!{sys.executable} -S\n"  # no site-packages: the sim's tools need the stdlib only
        f'"""The ddops sim\'s {tool} for the simulated host {root}."""\n'
        "import sys\n\n"
        f"sys.path.insert(0, {code_dir!r})\n"
        "from ops.sim.executables import main  # noqa: E402\n\n"
        f"raise SystemExit(main({tool!r}, root={str(root)!r}, in_ct={in_ct!r}))\n"
    )
    path.chmod(0o755)
