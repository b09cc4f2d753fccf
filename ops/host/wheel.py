"""This ddops as a wheel, to install the same version elsewhere: on a Proxmox host (the control
plane, for recovery at boot) or in a CT (with the engine extra).

    with built_wheel() as wheel:     # Path of ddops-<version>-py3-none-any.whl, or None
        ...                          # None: not running from a source tree (pip can fetch
                                     # ddops==<version> from the index instead)
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from ops.errors import DdopsError

PROJECT = Path(__file__).resolve().parents[2]


def ddops_version() -> str:
    return importlib.metadata.version("ddops")


@contextlib.contextmanager
def built_wheel() -> Iterator[Path | None]:
    """Build this ddops from its source tree into a temporary directory (removed after)."""
    if not (PROJECT / "pyproject.toml").is_file():
        yield None
        return
    with tempfile.TemporaryDirectory(prefix="ddops-wheel-") as out:
        build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
        # Fixed zip timestamps: the same tree gives the same bytes, so a copy of it is unchanged.
        env = {**os.environ, "SOURCE_DATE_EPOCH": "315532800"}
        proc = subprocess.run(
            [*build, "-w", out, str(PROJECT)], capture_output=True, text=True, env=env
        )
        if proc.returncode != 0:
            raise DdopsError(str(PROJECT), f"building the ddops wheel failed: {proc.stderr[-500:]}")
        yield next(Path(out).glob("ddops-*.whl"))
