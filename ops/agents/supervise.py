"""The engine's service manager where a container has no systemd (busybox, Alpine): a small supervisor.

It runs INSIDE the container, with the engine's own Python, and runs the same systemd unit that
a systemd container would run (one source of truth: ops/render.py's EngineUnit):

    python -m ops.agents.supervise start --unit /etc/ddops/ddops-engine.service   # detaches, then returns
    python -m ops.agents.supervise stop                                           # SIGTERM, then SIGKILL the group

`start` reads the unit's ExecStart=, Environment=, EnvironmentFile= and RestartSec=, detaches
(setsid: its own session and process group, stdio on the log) and returns once the pidfile is
written. The engine runs as systemd would run it, as far as a plain process can: as the unit's
User= and Group= (no supplementary groups), with an empty capability bounding set and no new
privileges (NoNewPrivileges=), the unit's UMask= and its CacheDirectory= made and owned by that
user. The namespace sandboxing a supervisor cannot give (ProtectSystem=, PrivateTmp=, ...) is
named in the log, once per start. A unit systemd would reject is refused here too: an
EnvironmentFile= that is not an absolute path as written (systemd reads it raw: a quoted path
is no path), AmbientCapabilities= (a supervisor cannot grant them). The supervisor then runs the engine and restarts it after RestartSec when it exits
non-zero or is killed (SIGKILL, SIGSEGV...), doubling the wait up to MAX_BACKOFF_S while it keeps
failing, as systemd's `Restart=on-failure` would; a clean exit (0, SIGTERM...) ends the service.
Files:

    /run/ddops/engine.pid          the supervisor's pid (the service)
    /run/ddops/engine.status       JSON: the engine's pid (null between runs), starts, exits, last_exit
    /var/log/ddops-engine.log      the engine's output and the supervisor's own lines

Standard library only: the controller (ops/chain/deploy.py) imports `parse_unit` from here, and the
container's Python runs it.
"""

from __future__ import annotations

import argparse
import ctypes
import grp
import json
import os
import pwd
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TextIO

PIDFILE = "/run/ddops/engine.pid"
STATUS_FILE = "/run/ddops/engine.status"
LOG_FILE = "/var/log/ddops-engine.log"
MAX_BACKOFF_S = 60.0
STABLE_RUN_S = 60.0  # a run this long resets the backoff
STOP_TIMEOUT_S = 20.0  # the engine drains for 5 s on SIGTERM; then the group is killed
SERVICE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"  # systemd's default
SUPERVISOR_MODULE = "ops.agents.supervise"
# Exits systemd counts as clean for Restart=on-failure: 0 and these signals.
CLEAN_SIGNALS = (signal.SIGHUP, signal.SIGINT, signal.SIGTERM, signal.SIGPIPE)


# -- the unit, read as systemd reads what ops/render.py writes --------------------------------------
# What the supervisor applies itself, and what only systemd's namespaces give (named in the log).
_APPLIED = {"ExecStart", "Environment", "EnvironmentFile", "RestartSec", "Restart", "Type"}
_APPLIED |= {"User", "Group", "UMask", "NoNewPrivileges", "CapabilityBoundingSet"}
_APPLIED |= {"AmbientCapabilities", "CacheDirectory"}
CACHE_ROOT = "/var/cache"
PR_SET_NO_NEW_PRIVS, PR_CAPBSET_DROP = 38, 24


@dataclass(frozen=True)
class UnitCommand:
    """What a unit runs: argv, its environment (Environment= lines), env files, restart delay,
    and the privileges it runs with."""

    argv: list[str]
    environment: dict[str, str] = field(default_factory=dict)
    environment_files: list[str] = field(default_factory=list)
    restart_sec: float = 0.1  # systemd's default RestartSec
    user: str | None = None  # None: root, as systemd without User=
    group: str | None = None  # a name or a numeric gid; None: the user's own group
    umask: int | None = None
    no_new_privileges: bool = False
    cache_directory: str | None = None  # below /var/cache, made and owned by the user
    unapplied: list[str] = field(default_factory=list)  # sandboxing only systemd gives


def unquote_systemd(value: str) -> list[str]:
    """Split a systemd command line into words: the quoting the unit templates emit (double quotes,
    backslash escapes) read back, then the doubled "%%" and "$$" made single again."""
    return [w.replace("%%", "%").replace("$$", "$") for w in shlex.split(value, posix=True)]


def parse_unit(text: str) -> UnitCommand:
    """The [Service] section's command, environment and privileges; ValueError for a unit
    systemd would not run as written (no ExecStart=, a relative or quoted EnvironmentFile=) or
    that asks what a supervisor cannot give (AmbientCapabilities=)."""
    argv: list[str] | None = None
    environment: dict[str, str] = {}
    env_files: list[str] = []
    settings: dict[str, str] = {}
    unapplied: list[str] = []
    section = ""
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("[") and line.endswith("]"):
            section = line
            continue
        if section != "[Service]" or "=" not in line or line.startswith(("#", ";")):
            continue
        key, value = (part.strip() for part in line.split("=", 1))
        if key == "ExecStart":
            argv = unquote_systemd(value)
        elif key == "Environment":
            environment.update(w.split("=", 1) for w in unquote_systemd(value) if "=" in w)
        elif key == "EnvironmentFile":
            env_files.append(env_file_path(value))
        elif key in _APPLIED:
            settings[key] = value
        else:
            unapplied.append(f"{key}={value}")
    if not argv:
        raise ValueError("the unit has no ExecStart= in [Service]")
    if settings.get("AmbientCapabilities"):
        raise ValueError(
            f"AmbientCapabilities={settings['AmbientCapabilities']}: the ddops supervisor grants "
            "no capabilities (serve on a port >= 1024)"
        )
    umask = settings.get("UMask")
    return UnitCommand(
        argv,
        environment,
        env_files,
        float(settings.get("RestartSec", UnitCommand.restart_sec).removesuffix("s")),
        user=settings.get("User") or None,
        group=settings.get("Group") or None,
        umask=int(umask, 8) if umask else None,
        no_new_privileges=settings.get("NoNewPrivileges", "no") in ("yes", "true", "1", "on"),
        cache_directory=settings.get("CacheDirectory") or None,
        unapplied=unapplied,
    )


def env_file_path(value: str) -> str:
    """EnvironmentFile='s value as systemd reads it: raw, an optional leading "-", then an
    absolute path (systemd ignores any other, e.g. a quoted one, and the "-" hides that)."""
    path = value.removeprefix("-")
    if not path.startswith("/") or any(c.isspace() or c in "\"'" for c in path):
        raise ValueError(
            f"EnvironmentFile={value}: not an absolute path as written (systemd reads it raw)"
        )
    return value


def read_env_file(path: str) -> dict[str, str]:
    """KEY=VALUE lines as systemd's EnvironmentFile= reads them (comments, optional quotes).
    A path written "-/x" may be missing."""
    optional = path.startswith("-")
    try:
        text = Path(path.removeprefix("-")).read_text()
    except FileNotFoundError:
        if optional:
            return {}
        raise
    env = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")) or "=" not in line:
            continue
        key, value = line.split("=", 1)
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
            value = value[1:-1]
        env[key.strip()] = value
    return env


def service_environment(command: UnitCommand) -> dict[str, str]:
    """The engine's environment: systemd's small default, then Environment=, then the files."""
    env = {"PATH": SERVICE_PATH, "LANG": "C.UTF-8"}
    env.update(command.environment)
    for path in command.environment_files:
        env.update(read_env_file(path))
    return env


def is_clean_exit(code: int) -> bool:
    """Popen's returncode (negative: the signal) as systemd judges it."""
    return code == 0 or -code in CLEAN_SIGNALS


# -- the supervisor's state on disk ------------------------------------------------------------
@dataclass
class Status:
    engine_pid: int | None = None
    starts: int = 0
    exits: int = 0
    last_exit: int | None = None  # the exit code; negative: killed by that signal


def _prctl(option: int, arg: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({option}, {arg})")


def _write_atomic(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def running_supervisor(pidfile: str = PIDFILE) -> int | None:
    """The pid in the pidfile when that process is alive and is this supervisor."""
    try:
        pid = int(Path(pidfile).read_text().strip())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ValueError):
        return None
    return pid if SUPERVISOR_MODULE.encode() in cmdline else None


class Supervisor:
    """Runs the unit's command until told to stop, restarting it on failure with backoff."""

    def __init__(
        self, command: UnitCommand, env: dict[str, str], status_file: str, log_file: str
    ) -> None:
        self.command = command
        self.env = env
        self.status_file = status_file
        self.log_file = log_file
        self.log: TextIO = sys.stderr
        self.status = Status()
        self.stopping = threading.Event()
        self.engine: subprocess.Popen | None = None

    def take_over_stdio(self) -> None:
        """Become a daemon's process: stdin from /dev/null, stdout and stderr to the log."""
        self.log = open(self.log_file, "a", buffering=1)  # noqa: SIM115 - open for its life
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(self.log.fileno(), 1)
        os.dup2(self.log.fileno(), 2)

    def credentials(self) -> tuple[int, int] | None:
        """(uid, gid) the engine runs as; None: as the supervisor (no User=, or not root)."""
        if self.command.user is None or os.geteuid() != 0:
            return None
        try:
            account = pwd.getpwnam(self.command.user)
        except KeyError:
            raise ValueError(f"User={self.command.user}: no such user") from None
        group = self.command.group
        if group is None or group.isdigit():
            return account.pw_uid, int(group) if group else account.pw_gid
        try:
            return account.pw_uid, grp.getgrnam(group).gr_gid
        except KeyError:
            raise ValueError(f"Group={group}: no such group") from None

    def drop_privileges(self) -> None:
        """In the engine's process before it execs: no capabilities left to gain back, the
        unit's user and group (no supplementary groups), no new privileges."""
        ids = self.credentials()
        if ids is not None:
            for cap in range(int(Path("/proc/sys/kernel/cap_last_cap").read_text()) + 1):
                _prctl(PR_CAPBSET_DROP, cap)
            os.setgroups([])
            os.setgid(ids[1])
            os.setuid(ids[0])
        if self.command.no_new_privileges:
            _prctl(PR_SET_NO_NEW_PRIVS, 1)

    def prepare(self) -> None:
        """What systemd does before the first start: the cache directory, owned by the user;
        and the sandboxing a supervisor cannot give, named once."""
        if self.command.cache_directory:
            path = Path(CACHE_ROOT) / self.command.cache_directory
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
            if (ids := self.credentials()) is not None:
                os.chown(path, *ids)
        if self.command.unapplied:
            self.say("not applied without systemd: " + ", ".join(self.command.unapplied))
        who = self.credentials()
        self.say(
            f"the engine runs as uid:gid {who[0]}:{who[1]}"
            if who
            else "the engine runs as this user"
        )

    def say(self, message: str) -> None:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime())
        self.log.write(f"{stamp} ddops-supervise: {message}\n")
        self.log.flush()

    def save(self) -> None:
        _write_atomic(self.status_file, json.dumps(asdict(self.status)))

    def on_sigterm(self, signum, frame) -> None:
        self.stopping.set()
        if self.engine and self.engine.poll() is None:
            self.engine.send_signal(signal.SIGTERM)

    def run(self) -> int:
        self.prepare()
        delay = self.command.restart_sec
        while not self.stopping.is_set():
            started = time.monotonic()
            code = self.run_once()
            if self.stopping.is_set() or is_clean_exit(code):
                self.say(f"engine exited with {code}; supervisor ends")
                return 0
            if time.monotonic() - started >= STABLE_RUN_S:
                delay = self.command.restart_sec
            self.say(f"engine exited with {code}; restarting in {delay:g} s")
            self.stopping.wait(delay)  # a SIGTERM ends the wait at once
            delay = min(delay * 2, MAX_BACKOFF_S)
        return 0

    def run_once(self) -> int:
        self.engine = subprocess.Popen(
            self.command.argv,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=self.log,
            stderr=self.log,
            umask=self.command.umask if self.command.umask is not None else -1,
            preexec_fn=self.drop_privileges,  # noqa: PLW1509 - the supervisor runs no other thread
        )
        if self.stopping.is_set():  # a SIGTERM came while it was being started
            self.engine.terminate()
        self.status.engine_pid = self.engine.pid
        self.status.starts += 1
        self.save()
        self.say(f"engine started (pid {self.engine.pid})")
        code = self.engine.wait()
        self.status.engine_pid, self.status.last_exit = None, code
        self.status.exits += 1
        self.save()
        return code


# -- start / stop ------------------------------------------------------------------------------
def start(unit: str, pidfile: str, status_file: str, log_file: str) -> int:
    """Detach a supervisor for `unit` unless one runs; returns its pid once its pidfile exists."""
    pid = running_supervisor(pidfile)
    if pid is not None:
        return pid
    command = parse_unit(Path(unit).read_text())  # a bad unit fails here, in the caller's view
    env = service_environment(command)  # and so does a missing EnvironmentFile
    supervisor = Supervisor(command, env, status_file, log_file)
    supervisor.credentials()  # and an unknown User=
    stop(pidfile)  # an engine left behind by a killed supervisor would hold the port
    os.makedirs(os.path.dirname(log_file), exist_ok=True)
    ready_r, ready_w = os.pipe()
    child = os.fork()
    if child:
        os.close(ready_w)
        with os.fdopen(ready_r) as ready:
            answer = ready.read()  # the supervisor closes its end once the pidfile is written
        os.waitpid(child, 0)
        if not answer.isdigit():
            raise RuntimeError(answer or "the supervisor died before writing its pidfile")
        return int(answer)
    os.close(ready_r)
    os.setsid()
    if os.fork():  # the session leader's child runs on, reparented to init
        os._exit(0)
    _become_daemon(supervisor, pidfile, ready_w)


def _become_daemon(supervisor: Supervisor, pidfile: str, ready_w: int) -> None:
    """The detached process: write the pidfile, tell the caller, supervise, never return."""
    code = 1
    try:
        supervisor.take_over_stdio()
        os.setpgid(0, 0)  # its own process group: `stop` can kill the engine with it
        signal.signal(signal.SIGTERM, supervisor.on_sigterm)
        _write_atomic(pidfile, f"{os.getpid()}\n")
        supervisor.save()
        os.write(ready_w, str(os.getpid()).encode())
        os.close(ready_w)
        code = supervisor.run()
        Path(pidfile).unlink(missing_ok=True)
    finally:
        os._exit(code)


def stop(pidfile: str, timeout: float = STOP_TIMEOUT_S) -> bool:
    """Stop the service: SIGTERM the supervisor (it stops the engine), or, when the supervisor is
    gone, what is left of its process group; SIGKILL the group after `timeout`.
    True when something was running."""
    try:
        pgid = int(Path(pidfile).read_text().strip())
    except (FileNotFoundError, ValueError):
        return False
    if not _service_group(pgid):  # a stale pidfile (after a CT restart the pid may be reused)
        Path(pidfile).unlink(missing_ok=True)
        return False
    if running_supervisor(pidfile):
        os.kill(pgid, signal.SIGTERM)  # the engine gets one SIGTERM, from the supervisor
    else:
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    # Not our children: no event to await their exit, so poll /proc.
    while _service_group(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if _service_group(pgid):
        os.killpg(pgid, signal.SIGKILL)
    Path(pidfile).unlink(missing_ok=True)
    return True


def _service_group(pgid: int) -> list[int]:
    """The live processes of process group `pgid` that are the supervisor or the engine."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except (FileNotFoundError, ProcessLookupError):
            continue  # it exited while we looked
        fields_after_name = stat.rsplit(")", 1)[1].split()  # state ppid pgrp ...
        state, group = fields_after_name[0], int(fields_after_name[2])
        ours = SUPERVISOR_MODULE.encode() in cmdline or b"engine\0serve" in cmdline
        if group == pgid and state != "Z" and ours:
            members.append(int(entry.name))
    return members


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ops.agents.supervise", description=__doc__.split("\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    start_cmd = sub.add_parser("start", help="start the supervisor for a unit unless it runs")
    start_cmd.add_argument("--unit", required=True)
    start_cmd.add_argument("--status-file", default=STATUS_FILE)
    start_cmd.add_argument("--log", default=LOG_FILE)
    sub.add_parser("stop", help="stop the supervisor and the engine")
    for command in sub.choices.values():
        command.add_argument("--pidfile", default=PIDFILE)
    args = parser.parse_args(argv)
    try:
        if args.command == "start":
            print(start(args.unit, args.pidfile, args.status_file, args.log))
        else:
            print("stopped" if stop(args.pidfile) else "not running")
    except (OSError, ValueError, RuntimeError) as exc:
        print(f"ddops-supervise: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
