"""The bench result store: one directory per run, a manifest, one JSON file per finished cell.

    RESULTS/<stamp>-<fingerprint>/manifest.json        state running | complete | crashed, pid,
                                                        host, config, versions, started, finished,
                                                        machine (what the machine was doing)
    RESULTS/<run>/cell-<key>.json                      a finished cell, written atomically
    RESULTS/<run>/cell-<key>.partial.jsonl             samples of the cell being measured
    RESULTS/<run>/crashed-<stamp>/                     partial files of a crashed attempt

    store = RunStore.open(results_dir, config, versions)  # resumes an unfinished run of `config`
    if not store.has_cell(key): ...; store.write_cell(key, data)
    store.finish()

A run whose manifest says running, started on this machine, whose pid is gone, is stale:
`quarantine_run` marks it crashed and moves its partial files (everything but the manifest and
the finished cells) into `crashed-<UTC stamp>/`; nothing is ever deleted. `RunStore.open` does
that to every stale run first, then resumes the newest unfinished run with the same config
fingerprint, measuring only its missing cells. The recover chain's check 10 calls
`find_stale_runs` and `quarantine_run`, so the store sits below both the chain and the bench.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ops.errors import DdopsError

MANIFEST = "manifest.json"
CELL_PREFIX = "cell-"
PARTIAL_SUFFIX = ".partial.jsonl"
RUNNING, COMPLETE, CRASHED = "running", "complete", "crashed"


def utc_stamp() -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())


def utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def write_json_atomic(path: Path, data: dict) -> None:
    """Write `data` to `path` so a reader sees the old file or the whole new one, never a part."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_json(path: Path) -> dict | None:
    """The JSON object in `path`, or None when it is absent or not a whole JSON object."""
    try:
        data = json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def fingerprint(config: dict) -> str:
    """A short digest of a run's config: runs with equal fingerprints measure the same cells."""
    canonical = json.dumps(config, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:12]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, owned by another user
        return True
    return True


# -- stale runs (the recover chain's check 10) ------------------------------------------------
def is_stale(run_dir: Path) -> bool:
    """The manifest says running, on this machine, and its process is gone."""
    manifest = read_json(run_dir / MANIFEST)
    return (
        manifest is not None
        and manifest.get("state") == RUNNING
        and manifest.get("host") == socket.gethostname()
        and isinstance(manifest.get("pid"), int)
        and not pid_alive(manifest["pid"])
    )


def find_stale_runs(results_dir: Path) -> list[Path]:
    """Runs in `results_dir` whose manifest says running but whose process is gone."""
    results_dir = Path(results_dir)
    if not results_dir.is_dir():
        return []
    return [run for run in sorted(results_dir.iterdir()) if run.is_dir() and is_stale(run)]


def _is_finished_cell(path: Path) -> bool:
    return (
        path.name.startswith(CELL_PREFIX) and path.suffix == ".json" and read_json(path) is not None
    )


def quarantine_run(run_dir: Path, reason: str = "its process is gone") -> Path:
    """Mark the run crashed; move its partial files into `crashed-<stamp>/`. Returns that dir."""
    run_dir = Path(run_dir)
    aside = run_dir / f"crashed-{utc_stamp()}"
    aside.mkdir(exist_ok=True)
    for path in sorted(run_dir.iterdir()):
        keep = path.name == MANIFEST or path.name.startswith("crashed-") or _is_finished_cell(path)
        if not keep:
            path.rename(aside / path.name)
    manifest = read_json(run_dir / MANIFEST) or {}
    crash = {"at": utc_now(), "pid": manifest.get("pid"), "reason": reason, "moved_to": aside.name}
    manifest.update(state=CRASHED, crashes=[*manifest.get("crashes", []), crash])
    write_json_atomic(run_dir / MANIFEST, manifest)
    return aside


# -- the store of one run ---------------------------------------------------------------------
@dataclass
class RunStore:
    """One run's directory; every write is atomic (see the module docstring for the layout)."""

    run_dir: Path
    manifest: dict

    @classmethod
    def open(cls, results_dir: Path, config: dict, versions: dict) -> RunStore:
        """Quarantine stale runs, then resume the newest unfinished run of `config` or start one."""
        results_dir = Path(results_dir)
        results_dir.mkdir(parents=True, exist_ok=True)
        for stale in find_stale_runs(results_dir):
            quarantine_run(stale)
        digest = fingerprint(config)
        resumable = list(_runs_of(results_dir, digest))
        if resumable:
            return cls._resume(resumable[-1], versions)
        run_dir = _new_run_dir(results_dir, f"{utc_stamp()}-{digest}")
        manifest = {
            "state": RUNNING,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "fingerprint": digest,
            "config": config,
            "versions": versions,
            "started": utc_now(),
            "finished": None,
            "attempts": [{"pid": os.getpid(), "started": utc_now()}],
        }
        store = cls(run_dir, manifest)
        store._save()
        return store

    @classmethod
    def load(cls, run_dir: Path) -> RunStore:
        """An existing run, to read (`ddops bench report`)."""
        manifest = read_json(Path(run_dir) / MANIFEST)
        if manifest is None:
            raise DdopsError(str(run_dir), f"not a bench run (no readable {MANIFEST})")
        return cls(Path(run_dir), manifest)

    @classmethod
    def _resume(cls, run_dir: Path, versions: dict) -> RunStore:
        manifest = read_json(run_dir / MANIFEST)
        attempt = {"pid": os.getpid(), "started": utc_now()}
        manifest.update(
            state=RUNNING,
            pid=os.getpid(),
            host=socket.gethostname(),
            versions=versions,
            attempts=[*manifest.get("attempts", []), attempt],
        )
        store = cls(run_dir, manifest)
        store._save()
        return store

    @property
    def resumed(self) -> bool:
        return len(self.manifest.get("attempts", [])) > 1

    def _save(self) -> None:
        write_json_atomic(self.run_dir / MANIFEST, self.manifest)

    def cell_path(self, key: str) -> Path:
        return self.run_dir / f"{CELL_PREFIX}{key}.json"

    def has_cell(self, key: str) -> bool:
        return read_json(self.cell_path(key)) is not None

    def cells(self) -> list[dict]:
        """Every finished cell, in file-name order."""
        paths = sorted(self.run_dir.glob(f"{CELL_PREFIX}*.json"))
        return [data for path in paths if (data := read_json(path)) is not None]

    def record_sample(self, key: str, sample: dict) -> None:
        """Append one measured request of an unfinished cell (kept if the run crashes)."""
        with (self.run_dir / f"{CELL_PREFIX}{key}{PARTIAL_SUFFIX}").open("a") as f:
            f.write(json.dumps(sample, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def write_cell(self, key: str, data: dict) -> None:
        """Store a finished cell atomically; its partial samples file goes."""
        write_json_atomic(self.cell_path(key), data)
        with contextlib.suppress(FileNotFoundError):
            (self.run_dir / f"{CELL_PREFIX}{key}{PARTIAL_SUFFIX}").unlink()

    def finish(self, machine: dict | None = None) -> None:
        """Mark the run complete; `machine`: what the machine was doing during this attempt."""
        self.manifest.update(state=COMPLETE, finished=utc_now())
        if machine is not None:
            self.manifest["machine"] = machine
        self._save()

    def fail(self, reason: str) -> Path:
        """This process gives up (an error, Ctrl-C): mark crashed, move partial files aside."""
        aside = quarantine_run(self.run_dir, reason)
        self.manifest = read_json(self.run_dir / MANIFEST)
        return aside


def _new_run_dir(results_dir: Path, name: str) -> Path:
    """A fresh directory `name` (or `name-2`, ... when runs start within the same second)."""
    for attempt in range(1, 1000):
        run_dir = results_dir / (name if attempt == 1 else f"{name}-{attempt}")
        with contextlib.suppress(FileExistsError):
            run_dir.mkdir()
            return run_dir
    raise DdopsError(str(results_dir), f"cannot make a new run directory {name}")


def _runs_of(results_dir: Path, digest: str) -> Iterator[Path]:
    """Unfinished runs (crashed) of the config with fingerprint `digest`, oldest first; a live
    run of the same config is an error: two processes must not write one run."""
    for run in sorted(results_dir.iterdir()):
        manifest = read_json(run / MANIFEST) if run.is_dir() else None
        if manifest is None or manifest.get("fingerprint") != digest:
            continue
        if manifest.get("state") == RUNNING:
            raise DdopsError(
                str(run),
                f"a bench run of the same config is in progress (pid {manifest.get('pid')} "
                f"on {manifest.get('host')})",
            )
        if manifest.get("state") == CRASHED:
            yield run
