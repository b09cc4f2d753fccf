"""A local Hugging Face hub: a stdlib HTTP server on loopback that serves model directories.

It answers the endpoints `huggingface_hub.snapshot_download` uses, so staging runs the real
client against it in tests and in `ddops demo`:

    GET  /api/models/{repo}/revision/{rev}            {"id", "sha", "siblings"}
    GET  /api/models/{repo}/tree/{sha}?recursive=true [{"type", "path", "size", "oid", "lfs"?}]
    HEAD /{repo}/resolve/{rev}/{path}                 X-Repo-Commit, ETag, Content-Length
    GET  /{repo}/resolve/{rev}/{path}                 the bytes (Range supported, for resumes)

Errors carry the hub's `X-Error-Code` (RepoNotFound, RevisionNotFound, EntryNotFound), so the
client raises its own typed errors. A repo is a directory ROOT/<org>/<name>; its commit is a
hash of its files, and it answers to "main" and to that sha. Like a real hub it keeps its
history: each commit it has served (its file list, and each file's bytes by sha256) is kept in
ROOT/.ddops-hub/, so after the directory changes ("main" moved) the older commit is still
served by its sha. `bytes_served` counts file bytes
sent, so tests can assert "zero bytes downloaded". With `token`, requests without
`Authorization: Bearer <token>` get 401 (the hub's answer for a private repo).

    python -m ops.sim.hub ROOT [--port 0] [--stats FILE]   # prints the URL, serves until stopped

With `stats_file` (`--stats`), the byte count is also kept there (JSON, written atomically as it
changes, carried on from the file when the hub starts again): how a hub running as its own
process (the sim host's, ops/sim/hubservice.py) tells what it served over the host's life.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import os
import re
import signal
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
HISTORY_DIR = ".ddops-hub"
_API = re.compile(
    r"^/api/models/(?P<repo>[^/]+/[^/]+)(?:/revision/(?P<rev>[^/]+)|/tree/(?P<tree>[^/]+)(?P<sub>/.*)?)?$"
)
_RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)$")


@dataclass(frozen=True)
class HubFile:
    path: str  # relative to the repo, POSIX
    size: int
    sha256: str
    git_oid: str  # git blob sha1, what the hub reports as a regular file's oid

    @property
    def is_lfs(self) -> bool:
        return self.path.endswith(LFS_SUFFIXES)

    @property
    def etag(self) -> str:
        return self.sha256 if self.is_lfs else self.git_oid


class HubError(Exception):
    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code = status, code


def _digest_file(repo_dir: Path, path: Path) -> HubFile:
    data = path.read_bytes()
    git_oid = hashlib.sha1(b"blob %d\x00" % len(data) + data, usedforsecurity=False).hexdigest()
    return HubFile(
        path.relative_to(repo_dir).as_posix(), len(data), hashlib.sha256(data).hexdigest(), git_oid
    )


class Repo:
    """One model directory at one commit: its files, and where their bytes are kept."""

    def __init__(
        self, repo_id: str, files: dict[str, HubFile], blobs: Path, stamp: int = 0
    ) -> None:
        self.repo_id = repo_id
        self.files = files
        self.blobs = blobs  # the bytes of each file, by sha256
        self.stamp = stamp  # the directory's newest mtime when read: a change is a new commit
        listing = "".join(f"{f.path}\x00{f.sha256}\n" for f in self.files.values())
        self.sha = hashlib.sha1(listing.encode(), usedforsecurity=False).hexdigest()

    def file(self, path: str) -> HubFile:
        if path not in self.files:
            raise HubError(404, "EntryNotFound", f"{path} does not exist in {self.repo_id}")
        return self.files[path]

    def read(self, f: HubFile) -> bytes:
        return (self.blobs / f.sha256).read_bytes()


def _read_repo(repo_id: str, directory: Path, history: Path, stamp: int) -> Repo:
    """The directory as a commit, its files' bytes and its file list kept in `history`."""
    found = sorted(p for p in directory.rglob("*") if p.is_file() and not p.name.startswith("."))
    files = {f.path: f for f in (_digest_file(directory, p) for p in found)}
    blobs = history / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    for f in files.values():
        if not (blobs / f.sha256).is_file():
            tmp = blobs / f".{f.sha256}.tmp"
            tmp.write_bytes((directory / f.path).read_bytes())
            os.replace(tmp, blobs / f.sha256)
    repo = Repo(repo_id, files, blobs, stamp)
    listing = history / "commits" / repo_id / f"{repo.sha}.json"
    listing.parent.mkdir(parents=True, exist_ok=True)
    listing.write_text(json.dumps([[f.path, f.size, f.sha256, f.git_oid] for f in files.values()]))
    return repo


def _kept_repo(repo_id: str, sha: str, history: Path) -> Repo | None:
    """A commit served before, from `history`."""
    try:
        listing = json.loads((history / "commits" / repo_id / f"{sha}.json").read_text())
    except (FileNotFoundError, ValueError):
        return None
    files = {path: HubFile(path, size, sha256, oid) for path, size, sha256, oid in listing}
    return Repo(repo_id, files, history / "blobs")


class LocalHub:
    """Serve ROOT/<org>/<name> directories as hub repos on 127.0.0.1."""

    def __init__(
        self,
        root: str | Path,
        *,
        port: int = 0,
        token: str | None = None,
        stats_file: Path | None = None,
    ) -> None:
        self.root = Path(root)
        self.token = token
        self.stats_file = stats_file
        self.bytes_served = served_before(stats_file)
        self.requests: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        self._repos: dict[str, Repo] = {}
        self._server = ThreadingHTTPServer(("127.0.0.1", port), _handler_for(self))
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> LocalHub:
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="local-hub", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> LocalHub:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def repo(self, repo_id: str, rev: str = "main") -> Repo:
        """The repo at `rev`: "main" is its files as they are now (re-read when they change,
        like a new push); a sha is any commit served before."""
        directory = self.root / repo_id
        if not directory.is_dir() or ".." in repo_id.split("/"):
            raise HubError(404, "RepoNotFound", f"Repository not found: {repo_id}")
        with self._lock:
            cached = self._repos.get(repo_id)
            stamp = max((p.stat().st_mtime_ns for p in directory.rglob("*")), default=0)
            if cached is None or cached.stamp != stamp:
                cached = self._repos[repo_id] = _read_repo(repo_id, directory, self.history, stamp)
            if rev in ("main", cached.sha):
                return cached
            if (kept := _kept_repo(repo_id, rev, self.history)) is not None:
                return kept
        raise HubError(404, "RevisionNotFound", f"Invalid rev id: {rev}")

    @property
    def history(self) -> Path:
        return self.root / HISTORY_DIR

    def authorised(self, header: str | None) -> bool:
        if self.token is None:
            return True
        expected = f"Bearer {self.token}"
        return header is not None and hmac.compare_digest(header.encode(), expected.encode())

    def count(self, method: str, path: str, sent: int) -> None:
        with self._lock:
            self.requests.append((method, path))
            self.bytes_served += sent
            if self.stats_file is not None and sent:
                tmp = self.stats_file.with_suffix(".tmp")
                tmp.write_text(json.dumps({"bytes_served": self.bytes_served}))
                os.replace(tmp, self.stats_file)


def _handler_for(hub: LocalHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args) -> None:  # quiet: tests read hub.requests
            pass

        def do_GET(self) -> None:
            self._serve(send_body=True)

        def do_HEAD(self) -> None:
            self._serve(send_body=False)

        def _serve(self, send_body: bool) -> None:
            path = unquote(urlsplit(self.path).path)
            query = urlsplit(self.path).query
            try:
                if not hub.authorised(self.headers.get("Authorization")):
                    raise HubError(
                        401, "RepoNotFound", "Invalid credentials in Authorization header"
                    )
                if m := _API.match(path):
                    self._api(m, "recursive=true" in query.lower() or "recursive=1" in query)
                elif m := _RESOLVE.match(path):
                    self._resolve(m, send_body)
                else:
                    raise HubError(404, "RepoNotFound", f"no route for {path}")
            except HubError as err:
                self._json({"error": str(err)}, status=err.status, extra={"X-Error-Code": err.code})
            hub.count(self.command, path, 0)

        def _api(self, m: re.Match, recursive: bool) -> None:
            repo = hub.repo(m["repo"], m["rev"] or m["tree"] or "main")
            if m["tree"] is None:
                siblings = [{"rfilename": p} for p in repo.files]
                self._json(
                    {
                        "id": repo.repo_id,
                        "modelId": repo.repo_id,
                        "sha": repo.sha,
                        "siblings": siblings,
                    }
                )
                return
            prefix = (m["sub"] or "").strip("/")
            entries = [_tree_entry(f) for f in repo.files.values() if f.path.startswith(prefix)]
            if not recursive:
                entries = [e for e in entries if "/" not in e["path"][len(prefix) :].strip("/")]
            self._json(entries)

        def _resolve(self, m: re.Match, send_body: bool) -> None:
            repo = hub.repo(m["repo"], m["rev"])
            f = repo.file(m["path"])
            data = repo.read(f)
            start, status = _range_start(self.headers.get("Range")), 200
            if start:
                data, status = data[start:], 206
            headers = {
                "X-Repo-Commit": repo.sha,
                "ETag": f'"{f.etag}"',
                "Content-Length": str(len(data)),
                "Content-Type": "application/octet-stream",
                "Accept-Ranges": "bytes",
            }
            if f.is_lfs:
                headers |= {"X-Linked-Etag": f'"{f.sha256}"', "X-Linked-Size": str(f.size)}
            if status == 206:
                headers["Content-Range"] = f"bytes {start}-{f.size - 1}/{f.size}"
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, v)
            self.end_headers()
            if send_body:
                self.wfile.write(data)
                hub.count("BODY", m["path"], len(data))

        def _json(self, body: object, status: int = 200, extra: dict | None = None) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            for k, v in {
                "Content-Type": "application/json",
                "Content-Length": str(len(data)),
                **(extra or {}),
            }.items():
                self.send_header(k, v)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

    return Handler


def served_before(stats_file: Path | None) -> int:
    """The byte count a hub kept in `stats_file` (0 without one)."""
    try:
        return int(json.loads(stats_file.read_text())["bytes_served"]) if stats_file else 0
    except (FileNotFoundError, KeyError, ValueError):
        return 0


def _tree_entry(f: HubFile) -> dict:
    entry = {"type": "file", "path": f.path, "size": f.size, "oid": f.git_oid}
    if f.is_lfs:
        entry["lfs"] = {"oid": f.sha256, "size": f.size, "pointerSize": 134}
    return entry


def _range_start(header: str | None) -> int:
    m = re.fullmatch(r"bytes=(\d+)-", header or "")
    return int(m[1]) if m else 0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m ops.sim.hub", description="Serve model dirs as a local HF hub."
    )
    parser.add_argument("root", help="directory holding <org>/<name> model directories")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--stats", type=Path, help="keep the counters in this JSON file")
    args = parser.parse_args(argv)
    # Blocked before the server's threads exist, so that every thread inherits the mask and the
    # main thread takes the signal in sigwait. (A handler setting an Event the main thread waits
    # on missed a SIGTERM that the kernel gave a server thread: the hub then ran on for good.)
    stop_signals = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)
    hub = LocalHub(args.root, port=args.port, stats_file=args.stats).start()
    print(hub.url, flush=True)
    signal.sigwait(stop_signals)
    # Then exit: the port closes with the process (the counts are on disk after each request).
    # hub.stop() would wait up to 0.5 s for serve_forever's next poll, on every sim reboot.


if __name__ == "__main__":
    main()
