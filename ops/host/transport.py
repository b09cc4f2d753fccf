"""The one seam for work on a host: run an argv, read a file, write a file atomically.

Every ddops action on a Proxmox host goes through a `Transport`:

    t = LocalTransport()                       # this machine
    t = LocalTransport(sysroot="/tmp/pve1")    # a simulated host (see ops/sim): paths and PATH mapped
    t = SSHTransport(...)                      # a real host over paramiko (ops/host/ssh.py)
    r = t.run(["pct", "status", "200"])        # Result(rc, stdout, stderr); never raises on rc != 0
    r.check("CT 200")                          # raises DdopsError naming the object and the cause
    t.write_file("/etc/pve/lxc/200.conf", data)  # atomic, previous version backed up
    with t.flock("/run/lock/lxc/pve-config-200.lock", timeout=10):  # flock(2), as pct takes it
        ...

Commands are argv lists, never shell strings; where a shell is unavoidable the argv is
quoted with `shlex.join`. A transport with a `sysroot` maps absolute host paths below it and
puts the sysroot's bin directories first on PATH, so a directory can play a whole host.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shlex
import subprocess
import tempfile
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath

from ops.errors import DdopsError

BACKUP_DIR = "/var/lib/ddops/backups"
SYSROOT_BIN_DIRS = ("usr/local/sbin", "usr/local/bin", "usr/sbin", "usr/bin", "sbin", "bin")


@dataclass(frozen=True)
class Result:
    """What a command did: its argv, exit code and decoded output."""

    argv: tuple[str, ...]
    rc: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.rc == 0

    def check(self, obj: str) -> Result:
        """Return self when rc == 0, else raise DdopsError naming `obj` and the command's own words."""
        if self.rc != 0:
            words = (self.stderr.strip() or self.stdout.strip()).splitlines()
            reason = words[-1] if words else "no output"
            raise DdopsError(obj, f"`{shlex.join(self.argv)}` exited {self.rc}: {reason}")
        return self


class CommandTimeout(DdopsError):
    """A command ran past its timeout (the process was killed)."""


class LockTimeout(DdopsError):
    """Another process held a host lock for longer than we would wait."""


LOCK_POLL_S = 0.2  # flock(2) has no timeout of its own: try, sleep, try again


# A constant script: export the NAME=VALUE lines read from stdin up to an empty line (the line
# itself is what `export` takes), then exec "$@" with the rest of stdin. `read` consumes a pipe
# byte by byte, so the command gets exactly the bytes after the empty line. Used where env must
# cross a process boundary (SSH, `pct exec`) without its values ever appearing on a command line.
ENV_FROM_STDIN_SCRIPT = 'while IFS= read -r kv && [ -n "$kv" ]; do export "${kv?}"; done; exec "$@"'
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def env_via_stdin(
    argv: Sequence[str], env: Mapping[str, str], input: str | None
) -> tuple[list[str], str]:
    """Wrap argv so `env` travels on stdin ahead of `input`; returns (argv, stdin)."""
    lines = []
    for name, value in env.items():
        if not _ENV_NAME.fullmatch(name) or "\n" in value or "\x00" in value:
            raise DdopsError(f"env {name!r}", "names must be identifiers, values one line")
        lines.append(f"{name}={value}\n")
    wrapped = ["sh", "-c", ENV_FROM_STDIN_SCRIPT, "ddops-env", *argv]
    return wrapped, "".join(lines) + "\n" + (input or "")


def validate_host_path(path: str) -> str:
    """An absolute, normalised POSIX path without '..' parts, or DdopsError."""
    p = PurePosixPath(path)
    if not p.is_absolute() or ".." in p.parts or "\x00" in path:
        raise DdopsError(path, "not an absolute host path without '..'")
    return str(p)


class Transport(ABC):
    """A host to act on. `label` names it in messages; `sysroot` maps host paths below a directory."""

    def __init__(self, label: str, sysroot: str | None = None) -> None:
        self.label = label
        self.sysroot = sysroot.rstrip("/") if sysroot else None

    # -- the primitives each implementation provides ------------------------------------------
    @abstractmethod
    def run(
        self,
        argv: Sequence[str],
        *,
        timeout: float | None = 60.0,
        input: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> Result:
        """Run argv; `env` values (secrets) never appear on a command line or in logs."""

    @abstractmethod
    def _read(self, real_path: str) -> bytes: ...

    @abstractmethod
    def _write_atomic(self, real_path: str, data: bytes, mode: int) -> None: ...

    @abstractmethod
    def _stat_mode(self, real_path: str) -> int | None:
        """The file's permission bits, or None when it does not exist."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections (SSH); nothing to do locally."""

    def flock(self, path: str, timeout: float) -> contextlib.AbstractContextManager[None]:
        """Hold an exclusive flock(2) on the host file `path` (made if absent) for the `with`
        block: the lock Proxmox's own tools take (pct on /run/lock/lxc/pve-config-<vmid>.lock).
        LockTimeout when another holder keeps it past `timeout` seconds. The lock ends with its
        holder: a crashed ddops leaves nothing behind."""
        raise DdopsError(self.label, f"this transport cannot lock {path}")

    # -- shared behaviour ---------------------------------------------------------------------
    def host_path(self, path: str) -> str:
        """Where a host path really lives (below sysroot for a simulated host)."""
        path = validate_host_path(path)
        return f"{self.sysroot}{path}" if self.sysroot else path

    def exists(self, path: str) -> bool:
        return self._stat_mode(self.host_path(path)) is not None

    def read_file(self, path: str) -> bytes:
        """The file's bytes; FileNotFoundError when absent."""
        return self._read(self.host_path(path))

    def read_text(self, path: str) -> str:
        return self.read_file(path).decode()

    def write_file(
        self, path: str, data: bytes | str, *, mode: int | None = None, backup: bool = True
    ) -> str | None:
        """Write atomically (temp file + fsync + rename); back up the previous version first.

        Returns the backup's host path, or None when there was no previous file.
        """
        if isinstance(data, str):
            data = data.encode()
        real = self.host_path(path)
        old_mode = self._stat_mode(real)
        backup_path = None
        if old_mode is not None and backup:
            backup_path = self.backup_path(path)
            self._write_atomic(self.host_path(backup_path), self._read(real), old_mode)
        self._write_atomic(real, data, mode if mode is not None else (old_mode or 0o644))
        return backup_path

    @staticmethod
    def backup_path(path: str) -> str:
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime()) + f".{time.time_ns() % 10**9:09d}"
        flat = path.strip("/").replace("/", "__")
        return f"{BACKUP_DIR}/{flat}.{stamp}"


class LocalTransport(Transport):
    """This machine, or a simulated host rooted at `sysroot`."""

    def __init__(self, sysroot: str | None = None, label: str | None = None) -> None:
        super().__init__(label or (f"sim:{sysroot}" if sysroot else "local"), sysroot)

    def _env(self, extra: Mapping[str, str] | None) -> dict[str, str]:
        env = dict(os.environ)
        if self.sysroot:
            bins = [
                f"{self.sysroot}/{d}"
                for d in SYSROOT_BIN_DIRS
                if os.path.isdir(f"{self.sysroot}/{d}")
            ]
            env["PATH"] = os.pathsep.join([*bins, env.get("PATH", "")])
        env.update(extra or {})
        return env

    def run(
        self,
        argv: Sequence[str],
        *,
        timeout: float | None = 60.0,
        input: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> Result:
        argv = tuple(str(a) for a in argv)
        try:
            proc = subprocess.run(
                argv,
                input=input,
                capture_output=True,
                text=True,
                timeout=timeout,
                env=self._env(env),
                stdin=None if input is not None else subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired as exc:
            raise CommandTimeout(
                self.label, f"`{shlex.join(argv)}` timed out after {timeout:g}s"
            ) from exc
        except FileNotFoundError:
            return Result(argv, 127, "", f"{argv[0]}: command not found")
        return Result(argv, proc.returncode, proc.stdout, proc.stderr)

    @contextlib.contextmanager
    def flock(self, path: str, timeout: float) -> Iterator[None]:
        real = self.host_path(path)
        os.makedirs(os.path.dirname(real), exist_ok=True)
        with open(real, "a") as f:
            deadline = time.monotonic() + timeout
            while True:
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise LockTimeout(
                            f"{self.label}: {path}", f"still locked after {timeout:g}s"
                        ) from None
                    time.sleep(LOCK_POLL_S)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def _read(self, real_path: str) -> bytes:
        with open(real_path, "rb") as f:
            return f.read()

    def _write_atomic(self, real_path: str, data: bytes, mode: int) -> None:
        directory = os.path.dirname(real_path)
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".ddops-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, mode)
            os.replace(tmp, real_path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    def _stat_mode(self, real_path: str) -> int | None:
        try:
            return os.stat(real_path).st_mode & 0o7777
        except FileNotFoundError:
            return None
