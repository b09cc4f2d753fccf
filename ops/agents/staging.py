"""Model staging: hub -> persistent on-disk cache -> /dev/shm/models/<name>, verified.

The agent half:

- the agent, run INSIDE the container by the engine's Python (which has huggingface_hub):
      python -m ops.agents.staging stage --model NAME ORG/REPO REV [--model ...] [--endpoint URL] [--refresh]
      python -m ops.agents.staging check --name NAME [--name ...] [--hashes]
  (several models a run, one Python start for all; one JSON line: {"models": [...]})
  `stage` makes sure the persistent cache holds the snapshot (downloading only what is missing or
  damaged, resumable), then copies it into /dev/shm, hashing while copying: a file lands in
  /dev/shm only once its bytes match the manifest taken when the snapshot was first downloaded
  and verified against the hub's own file list. A mismatch is fetched again from the hub; if it
  still does not match, or the hub cannot be reached, staging fails naming the file, and the
  copy is left unstaged (the stamp goes before the first file is replaced). An intact cache
  means zero bytes from the hub. Revisions are exact: the first download records the commit
  the revision (a branch, e.g. main) resolved to, and every later stage and every repair of the
  cache fetches that commit, never what the branch points at by then; only `--refresh`
  (provision's) asks the hub again and moves to the branch's new commit. The stamp
  (.ddops-staged.json) records the commit and each staged file's size, sha256 and mtime: `check`
  compares size and mtime (cheap), `check --hashes` the sha256 too, and reports the commit. The HF token is HF_TOKEN in its environment, carried into the CT on stdin by ct_exec,
  never on a command line. Every hub failure is one DdopsError naming the repo.
- the controller's half is ops/chain/stage_model.py (`stage_models`, `check_staged`): it runs
  this agent through `pct exec` over a Transport and turns its JSON into a report.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ops.errors import DdopsError
from ops.site.inventory import ModelRef

CACHE_DIR = "/var/cache/ddops/hf"
SHM_MODELS = "/dev/shm/models"  # nosec B108 - the CT's own tmpfs, the staging target by design
STAMP = ".ddops-staged.json"
CHUNK = 8 << 20


@dataclass
class FileEntry:
    path: str
    size: int
    sha256: str
    mtime_ns: int = 0  # in the staged stamp: the /dev/shm copy's mtime once verified


@dataclass
class Manifest:
    repo: str
    revision: str
    commit: str
    files: list[FileEntry]

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @classmethod
    def load(cls, path: Path) -> Manifest | None:
        try:
            data = json.loads(path.read_text())
            return cls(
                data["repo"],
                data["revision"],
                data["commit"],
                [FileEntry(**f) for f in data["files"]],
            )
        except (FileNotFoundError, KeyError, TypeError, ValueError):
            return None

    def save(self, path: Path) -> None:
        _atomic_write(path, json.dumps(asdict(self), indent=1).encode())


@dataclass
class StageReport:
    name: str
    changed: bool
    downloaded_files: list[str] = field(default_factory=list)
    copied_files: list[str] = field(default_factory=list)
    repaired_cache_files: list[str] = field(default_factory=list)
    bytes_total: int = 0
    commit: str = ""


# -- agent side (inside the container) -------------------------------------------------------
def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".ddops-")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _manifest_path(cache: Path, ref: ModelRef) -> Path:
    return (
        cache
        / "ddops-manifests"
        / f"{ref.repo.replace('/', '--')}@{ref.revision.replace('/', '--')}.json"
    )


# The hub client's own failures (its package, its HTTP client's) and the OS's; anything else
# is a bug and keeps its traceback.
_HUB_CLIENT_MODULES = ("huggingface_hub", "httpx", "httpx2", "requests", "urllib3")


@contextlib.contextmanager
def hub_errors(ref: ModelRef) -> Iterator[None]:
    """Turn every failure of the hub client into one clear DdopsError naming the repo."""
    from huggingface_hub.errors import (
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    obj = f"model {ref.repo}"
    try:
        yield
    except RepositoryNotFoundError as exc:
        raise DdopsError(
            obj, "repository not found on the hub (or no access: check HF_TOKEN)"
        ) from exc
    except RevisionNotFoundError as exc:
        raise DdopsError(obj, f"revision {ref.revision!r} not found on the hub") from exc
    except HfHubHTTPError as exc:
        raise DdopsError(obj, f"hub error: {_first_line(exc)}") from exc
    except LocalEntryNotFoundError as exc:
        raise DdopsError(obj, f"hub unreachable and not in the cache: {_first_line(exc)}") from exc
    except Exception as exc:
        if not _from_hub_client(exc):
            raise
        raise DdopsError(obj, f"hub error ({type(exc).__name__}): {_first_line(exc)}") from exc


def _from_hub_client(exc: BaseException) -> bool:
    module = type(exc).__module__.split(".")[0]
    return module in _HUB_CLIENT_MODULES or isinstance(exc, OSError | ValueError)


def _first_line(exc: BaseException) -> str:
    """The exception's message in one line (the hub client's run over several)."""
    cause = exc.__cause__ or exc.__context__
    text = " ".join(str(exc).split()) or type(exc).__name__
    if cause is not None and str(cause).strip() and str(cause) not in text:
        text += f" ({' '.join(str(cause).split())})"
    return text[:300]


def _download(
    ref: ModelRef,
    cache: Path,
    endpoint: str | None,
    token: str | None,
    force: list[str] | None = None,
    revision: str | None = None,
) -> Path:
    """snapshot_download of `revision` (a commit; default the ref's own revision): only missing
    files travel; `force` re-fetches damaged files."""
    from huggingface_hub import hf_hub_download, snapshot_download

    pinned = revision or ref.revision
    where = {"cache_dir": cache, "endpoint": endpoint, "token": token}
    with hub_errors(ref):
        for path in force or []:
            hf_hub_download(ref.repo, path, revision=pinned, force_download=True, **where)
        return Path(snapshot_download(ref.repo, revision=pinned, **where))


def _verified_manifest(
    ref: ModelRef, snapshot: Path, endpoint: str | None, token: str | None
) -> Manifest:
    """Hash the downloaded snapshot and check it against the hub's file list (sizes, LFS sha256)."""
    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import RepoFile

    commit = snapshot.name
    with hub_errors(ref):
        tree = HfApi(endpoint=endpoint, token=token).list_repo_tree(
            ref.repo, revision=commit, recursive=True
        )
        remote = {f.path: f for f in tree if isinstance(f, RepoFile)}
    files = []
    for path, info in sorted(remote.items()):
        local = snapshot / path
        entry = FileEntry(path, local.stat().st_size, _sha256(local))
        if entry.size != info.size or (info.lfs is not None and info.lfs.sha256 != entry.sha256):
            raise DdopsError(
                f"model {ref.repo}", f"{path} does not match the hub's size/hash after download"
            )
        files.append(entry)
    return Manifest(ref.repo, ref.revision, commit, files)


def _snapshot_dir(cache: Path, ref: ModelRef, commit: str) -> Path:
    return cache / f"models--{ref.repo.replace('/', '--')}" / "snapshots" / commit


def _copy_verified(src: Path, dest: Path, entry: FileEntry) -> bool:
    """Copy src to dest through a temp file, hashing as it goes; dest is replaced only when the
    bytes match `entry` (True), else nothing changes (False)."""
    if not src.is_file():
        return False
    digest = hashlib.sha256()
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=".ddops-")
    try:
        with open(src, "rb") as fin, os.fdopen(fd, "wb") as fout:
            while chunk := fin.read(CHUNK):
                digest.update(chunk)
                fout.write(chunk)
        if os.path.getsize(tmp) != entry.size or digest.hexdigest() != entry.sha256:
            Path(tmp).unlink()
            return False
        os.chmod(tmp, 0o644)  # the engine reads it as its own user, not root
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return True


def _ensure_space(shm_root: Path, manifest: Manifest, dest: Path) -> None:
    present = sum(p.stat().st_size for p in dest.rglob("*") if p.is_file()) if dest.exists() else 0
    need = manifest.total_bytes - present
    free = shutil.disk_usage(shm_root).free
    if need > free:
        raise DdopsError(
            f"{dest}",
            f"no space left in {shm_root}: the model needs {need / 2**30:.2f} GiB more, {free / 2**30:.2f} GiB free",
        )


def stage_local(
    ref: ModelRef,
    *,
    endpoint: str | None,
    token: str | None,
    cache: Path,
    shm_root: Path,
    log=print,
    refresh: bool = False,
) -> StageReport:
    """The agent's work: cache -> /dev/shm, downloading and repairing only what is needed, at
    the commit recorded when the revision was first resolved (`refresh`: resolve it again)."""
    report = StageReport(ref.name, changed=False)
    manifest_file = _manifest_path(cache, ref)
    manifest = Manifest.load(manifest_file)
    missing = manifest is None or not _snapshot_dir(cache, ref, manifest.commit).is_dir()
    if refresh or missing:
        pinned = None if refresh or manifest is None else manifest.commit
        log(f"downloading {ref.repo}@{pinned or ref.revision} into the cache")
        snapshot = _download(ref, cache, endpoint, token, revision=pinned)
        moved = manifest is None or snapshot.name != manifest.commit
        if moved:
            manifest = _verified_manifest(ref, snapshot, endpoint, token)
            manifest.save(manifest_file)
        if moved or missing:
            report.downloaded_files = [f.path for f in manifest.files]
    snapshot = _snapshot_dir(cache, ref, manifest.commit)
    dest = shm_root / ref.name
    dest.mkdir(parents=True, exist_ok=True)
    _ensure_space(shm_root, manifest, dest)
    stamped = _stamped_files(dest, manifest)
    staged = []
    for entry in manifest.files:
        target = dest / entry.path
        if entry.path in stamped and _unchanged(target, stamped[entry.path]):
            staged.append(stamped[entry.path])
            continue
        (dest / STAMP).unlink(missing_ok=True)  # not "staged" until every file is verified
        target.parent.mkdir(parents=True, exist_ok=True)
        if not _copy_verified(snapshot / entry.path, target, entry):
            log(f"cache copy of {entry.path} is damaged: downloading it again")
            try:
                _download(ref, cache, endpoint, token, [entry.path], revision=manifest.commit)
            except DdopsError as exc:
                raise DdopsError(
                    exc.obj,
                    f"{entry.path}: the cached copy does not match its sha256 and fetching it "
                    f"again failed: {exc.cause}",
                ) from exc
            report.repaired_cache_files.append(entry.path)
            if not _copy_verified(snapshot / entry.path, target, entry):
                raise DdopsError(
                    f"model {ref.repo}",
                    f"{entry.path} does not match its sha256 {entry.sha256[:12]}... even "
                    "after a fresh download: not staged",
                )
        report.copied_files.append(entry.path)
        staged.append(dataclasses.replace(entry, mtime_ns=target.stat().st_mtime_ns))
    _remove_extras(dest, {f.path for f in manifest.files})
    if report.copied_files or not (dest / STAMP).is_file():
        stamp = Manifest(manifest.repo, manifest.revision, manifest.commit, staged)
        _atomic_write(dest / STAMP, json.dumps(asdict(stamp)).encode())
    report.changed = bool(
        report.copied_files or report.downloaded_files or report.repaired_cache_files
    )
    report.bytes_total = manifest.total_bytes
    report.commit = manifest.commit
    return report


def _stamped_files(dest: Path, manifest: Manifest) -> dict[str, FileEntry]:
    """The files the stamp says were staged from this very manifest (path -> stamped entry)."""
    stamp = Manifest.load(dest / STAMP)
    if stamp is None or stamp.commit != manifest.commit:
        return {}
    wanted = {(f.path, f.size, f.sha256) for f in manifest.files}
    return {f.path: f for f in stamp.files if (f.path, f.size, f.sha256) in wanted}


def _unchanged(target: Path, stamped: FileEntry) -> bool:
    """Size and mtime as stamped: nothing wrote the file since it was verified (cheap: a stat)."""
    try:
        st = target.stat()
    except FileNotFoundError:
        return False
    return st.st_size == stamped.size and st.st_mtime_ns == stamped.mtime_ns


def _remove_extras(dest: Path, wanted: set[str]) -> None:
    for p in sorted(dest.rglob("*"), reverse=True):
        rel = p.relative_to(dest).as_posix()
        if p.is_file() and rel not in wanted and rel != STAMP:
            p.unlink()


def staged_commit(name: str, shm_root: Path) -> str | None:
    """The commit /dev/shm/models/<name> was staged from (None: not staged)."""
    stamp = Manifest.load(shm_root / name / STAMP)
    return stamp.commit if stamp else None


def check_local(name: str, shm_root: Path, hashes: bool = False) -> list[str]:
    """Problems with /dev/shm/models/<name> (empty list: complete): each file against the stamp,
    by size and mtime (a stat each), or also by sha256 with `hashes` (reads every byte)."""
    dest = shm_root / name
    stamp = Manifest.load(dest / STAMP)
    if stamp is None:
        return [f"{dest} is not staged (no {STAMP})"]
    problems = []
    for entry in stamp.files:
        target = dest / entry.path
        if not target.is_file():
            problems.append(f"{entry.path}: missing")
        elif target.stat().st_size != entry.size:
            problems.append(f"{entry.path}: {target.stat().st_size} bytes, expected {entry.size}")
        elif target.stat().st_mtime_ns != entry.mtime_ns:
            problems.append(f"{entry.path}: changed since it was staged (mtime)")
        elif hashes and _sha256(target) != entry.sha256:
            problems.append(f"{entry.path}: content differs (sha256)")
    return problems


def agent_main(argv: list[str] | None = None) -> int:
    """The agent's command line: several models a run (one Python start in the CT for all)."""
    parser = argparse.ArgumentParser(
        prog="python -m ops.agents.staging", description="Stage models into /dev/shm."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    stage = sub.add_parser("stage")
    stage.add_argument(
        "--model",
        nargs=3,
        action="append",
        required=True,
        metavar=("NAME", "REPO", "REVISION"),
        help="a model to stage into <shm>/NAME (repeat for each)",
    )
    stage.add_argument("--endpoint")
    stage.add_argument(
        "--refresh", action="store_true", help="resolve the revision again (a branch may move)"
    )
    check = sub.add_parser("check")
    check.add_argument("--name", action="append", required=True, help="repeat for each model")
    check.add_argument("--hashes", action="store_true")
    for p in (stage, check):
        p.add_argument("--cache", default=CACHE_DIR)
        p.add_argument("--shm", default=SHM_MODELS)
    args = parser.parse_args(argv)
    try:
        models = _checked(args) if args.command == "check" else _staged(args)
    except DdopsError as exc:
        print(json.dumps({"error": str(exc)}))
        return 1
    print(json.dumps({"models": models}))
    return 0


def _checked(args: argparse.Namespace) -> list[dict]:
    shm = Path(args.shm)
    reports = []
    for name in args.name:
        problems = check_local(name, shm, args.hashes)
        commit = staged_commit(name, shm)
        reports.append(
            {"name": name, "complete": not problems, "problems": problems, "commit": commit}
        )
    return reports


def _staged(args: argparse.Namespace) -> list[dict]:
    token = os.environ.get("HF_TOKEN") or None
    return [
        asdict(
            stage_local(
                ModelRef(repo, revision, name),
                endpoint=args.endpoint,
                token=token,
                cache=Path(args.cache),
                shm_root=Path(args.shm),
                log=lambda msg: print(msg, file=sys.stderr, flush=True),
                refresh=args.refresh,
            )
        )
        for name, repo, revision in args.model
    ]


if __name__ == "__main__":
    sys.exit(agent_main())
