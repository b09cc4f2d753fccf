"""Stale bench runs: the run-manifest layout the recover chain's last check reads (check 10).

A results directory holds one directory per run:

    RESULTS/<run-id>/manifest.json   {"state": "running" | "complete" | "crashed",
                                      "pid": 1234, "host": "<hostname of the bench client>", ...}
    RESULTS/<run-id>/<cell>.json     one finished cell each, written atomically
    RESULTS/<run-id>/<anything else> partial output of an unfinished cell

A run is stale when its manifest says running, it was started on this machine, and its pid is
gone. `quarantine_run` marks it crashed and moves its partial files (everything but the manifest
and the finished cells) into `crashed-<UTC stamp>/` inside the run: nothing is deleted, and a
rerun can resume the cells still missing. ops/bench/store.py (the bench's own result store)
provides the same two functions; the chain uses it when it is installed.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

MANIFEST = "manifest.json"


def _manifest(run: Path) -> dict | None:
    try:
        data = json.loads((run / MANIFEST).read_text())
    except (FileNotFoundError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def is_stale(run: Path) -> bool:
    manifest = _manifest(run)
    return (
        manifest is not None
        and manifest.get("state") == "running"
        and manifest.get("host") == socket.gethostname()
        and isinstance(manifest.get("pid"), int)
        and not _pid_alive(manifest["pid"])
    )


def find_stale_runs(results_dir: Path) -> list[Path]:
    """Runs in `results_dir` whose manifest says running but whose process is gone."""
    if not results_dir.is_dir():
        return []
    return [run for run in sorted(results_dir.iterdir()) if run.is_dir() and is_stale(run)]


def _finished_cell(path: Path) -> bool:
    if path.name == MANIFEST or path.suffix != ".json" or path.name.startswith("."):
        return False
    try:
        json.loads(path.read_text())
    except ValueError:
        return False
    return True


def quarantine_run(run: Path) -> Path:
    """Mark the run crashed and move its partial files aside; the directory they went to."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    aside = run / f"crashed-{stamp}"
    aside.mkdir(exist_ok=True)
    for path in sorted(run.iterdir()):
        if path == aside or path.name.startswith("crashed-") or path.name == MANIFEST:
            continue
        if not _finished_cell(path):
            path.rename(aside / path.name)
    manifest = _manifest(run) or {}
    manifest.update(state="crashed", quarantined_to=aside.name)
    tmp = run / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, run / MANIFEST)
    return aside
