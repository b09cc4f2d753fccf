"""Proxmox VE facts and actions through `pct` and `pveversion`, over any Transport.

    ct_status(t, 200)            # "running" | "stopped" | None (no such CT)
    ct_config(t, 200)["memory"]  # parsed `pct config`
    ct_start(t, 200)             # True when it started it, False when it was already running
    ct_exec(t, 200, ["nvidia-smi", "-L"], env={"HF_TOKEN": token})  # the command's Result
    supports_dev_entries(pve_version(t))  # PVE >= 8.1 knows `devN:` entries
    hotplugs_dev_entries(pve_version(t))  # PVE >= 9 attaches a new devN to a running CT
    ct_set(t, 200, {"dev3": "/dev/nvidia-uvm-tools,gid=44"})  # `pct set 200 --dev3 ...`
    with ct_config_lock(t, 200):  # Proxmox's own lock on the CT config, the one `pct set` takes
        edit /etc/pve/lxc/200.conf

Every vmid is validated before it reaches a command. pct's own failures keep its words; the
two that need a decision become clear DdopsErrors: a missing CT ("Configuration file
'nodes/<node>/lxc/<vmid>.conf' does not exist") and a locked one ("CT is locked (backup)").
The start/stop/shutdown/unlock helpers read the state first and act only when needed, since
pct itself is not idempotent (`pct start` on a running CT fails). Tests: tests/ops/host/test_pve.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from ops.errors import DdopsError
from ops.host.transport import LockTimeout, Result, Transport, env_via_stdin, validate_host_path

VMID_RANGE = range(100, 1_000_000_000)
VMID_RULE = f"a vmid is a number from {VMID_RANGE.start} to {VMID_RANGE.stop - 1}"
PCT_TASK_ERROR = 255  # pct's exit code for its own failures
# PVE::LXC::Config->lock_config: flock on this file, waiting up to 10 s, around every config edit
CONFIG_LOCK = "/run/lock/lxc/pve-config-{vmid}.lock"
CONFIG_LOCK_TIMEOUT_S = 10.0
_MISSING_CT = re.compile(r"Configuration file 'nodes/[^/]+/lxc/\d+\.conf' does not exist")
_LOCKED = re.compile(r"CT is locked \((\w+)\)")
_STATUS = re.compile(r"^status: (\w+)$", re.M)
_CONFIG_LINE = re.compile(r"([a-z][a-z0-9_.\-]*): ?(.*)")
_PVEVERSION = re.compile(r"pve-manager/(\d+)\.(\d+)[.-](\d+)\S*(?: \(running kernel: ([^)\s]+)\))?")


def validate_vmid(vmid: int | str) -> str:
    """The vmid as pct wants it (digits, 100..999999999), or DdopsError."""
    text = str(vmid)
    if not (text.isascii() and text.isdigit()) or int(text) not in VMID_RANGE:
        raise DdopsError(f"CT {text!r}", VMID_RULE)
    return str(int(text))


# -- facts -------------------------------------------------------------------------------------
def ct_status(t: Transport, vmid: int | str) -> str | None:
    """ "running" or "stopped"; None when the CT does not exist."""
    vmid = validate_vmid(vmid)
    r = t.run(["pct", "status", vmid])
    if not r.ok and _MISSING_CT.search(r.stderr):
        return None
    match = _STATUS.search(_checked(r, vmid).stdout)
    if not match or match[1] not in ("running", "stopped"):
        raise DdopsError(f"CT {vmid}", f"unexpected `pct status` output: {r.stdout.strip()!r}")
    return match[1]


@dataclass(frozen=True)
class CtConfig:
    """`pct config` as (key, value) pairs in order; raw `lxc.*` keys may repeat."""

    entries: tuple[tuple[str, str], ...]

    def __getitem__(self, key: str) -> str:
        value = self.get(key)
        if value is None:
            raise KeyError(key)
        return value

    def __contains__(self, key: object) -> bool:
        return any(k == key for k, _ in self.entries)

    def get(self, key: str, default: str | None = None) -> str | None:
        """The key's (first) value."""
        return next((v for k, v in self.entries if k == key), default)

    def all(self, key: str) -> list[str]:
        """Every value of a repeatable key, e.g. `lxc.cgroup2.devices.allow`."""
        return [v for k, v in self.entries if k == key]


def parse_pct_config(text: str) -> CtConfig:
    """Parse `pct config` output; a line that is not `key: value` continues the previous value
    (a multi-line description)."""
    entries: list[tuple[str, str]] = []
    for line in text.splitlines():
        match = _CONFIG_LINE.fullmatch(line)
        if match:
            entries.append((match[1], match[2]))
        elif entries:
            key, value = entries[-1]
            entries[-1] = (key, f"{value}\n{line}")
    return CtConfig(tuple(entries))


def ct_config(t: Transport, vmid: int | str) -> CtConfig:
    """The CT's current configuration (`pct config`); DdopsError when the CT does not exist."""
    vmid = validate_vmid(vmid)
    return parse_pct_config(_pct(t, vmid, "config").stdout)


def ct_lock(t: Transport, vmid: int | str) -> str | None:
    """The CT's `lock:` (backup, migrate, snapshot, ...), or None."""
    return ct_config(t, vmid).get("lock")


@dataclass(frozen=True, order=True)
class PveVersion:
    """The pve-manager release and the running kernel."""

    major: int
    minor: int
    patch: int
    kernel: str | None = dataclasses.field(default=None, compare=False)

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}.{self.patch}"


def parse_pveversion(text: str) -> PveVersion:
    """Parse `pveversion` ("pve-manager/8.2.4/faa83925c9641325 (running kernel: 6.8.12-1-pve)";
    PVE 7 wrote "pve-manager/7.4-3/9002ab8a")."""
    match = _PVEVERSION.search(text)
    if not match:
        raise DdopsError("pveversion", f"unrecognised output: {text.strip()!r}")
    return PveVersion(int(match[1]), int(match[2]), int(match[3]), match[4])


def pve_version(t: Transport) -> PveVersion:
    r = t.run(["pveversion"])
    if r.rc == 127:
        raise DdopsError(t.label, "not a Proxmox VE host (no pveversion)")
    return parse_pveversion(r.check(t.label).stdout)


def supports_dev_entries(version: PveVersion) -> bool:
    """`devN:` CT config entries arrived in PVE 8.1."""
    return (version.major, version.minor) >= (8, 1)


def hotplugs_dev_entries(version: PveVersion) -> bool:
    """PVE 9 (pve-container 6.0.4) attaches a `devN:` entry that `pct set` adds to a running CT;
    before, it applies at the CT's next start."""
    return version.major >= 9


# -- actions -----------------------------------------------------------------------------------
@contextlib.contextmanager
def ct_config_lock(
    t: Transport, vmid: int | str, timeout: float = CONFIG_LOCK_TIMEOUT_S
) -> Iterator[None]:
    """Hold Proxmox's config lock of the CT (what `pct set` and the API take around an edit),
    so a concurrent `pct set` waits for our read-modify-write instead of being lost. Call no
    pct command that edits the config inside: it would wait for this lock."""
    vmid = validate_vmid(vmid)
    try:
        with t.flock(CONFIG_LOCK.format(vmid=vmid), timeout):
            yield
    except LockTimeout as exc:
        raise DdopsError(
            f"CT {vmid}",
            f"its config is being changed by another task "
            f"({CONFIG_LOCK.format(vmid=vmid)} still locked after {timeout:g}s)",
        ) from exc


def ct_start(t: Transport, vmid: int | str, *, timeout: float = 120.0) -> bool:
    """Start the CT unless it runs; True when something changed."""
    return _transition(t, vmid, "start", "running", timeout=timeout)


def ct_stop(t: Transport, vmid: int | str, *, timeout: float = 120.0) -> bool:
    """Stop the CT at once (no clean shutdown) unless it is stopped; True when it changed."""
    return _transition(t, vmid, "stop", "stopped", timeout=timeout)


def ct_shutdown(
    t: Transport, vmid: int | str, *, timeout_s: int = 60, force_stop: bool = False
) -> bool:
    """Shut the CT down cleanly unless it is stopped (`force_stop`: kill it after timeout_s)."""
    options = ["--timeout", str(timeout_s)] + (["--forceStop", "1"] if force_stop else [])
    return _transition(t, vmid, "shutdown", "stopped", options, timeout=timeout_s + 30.0)


def ct_unlock(t: Transport, vmid: int | str) -> bool:
    """Remove the CT's lock if it has one; True when it did."""
    vmid = validate_vmid(vmid)
    if ct_lock(t, vmid) is None:
        return False
    _pct(t, vmid, "unlock")
    return True


def ct_set(t: Transport, vmid: int | str, options: Mapping[str, str]) -> Result:
    """`pct set <vmid> --key value ...` (it takes the config lock itself); its Result (stderr
    holds pct's warnings, e.g. a hot-plug it could not do)."""
    vmid = validate_vmid(vmid)
    for key in options:
        if not re.fullmatch(r"[a-z][a-z0-9]*", key):
            raise DdopsError(f"CT {vmid}", f"`pct set` option {key!r}: not a pct option name")
    return _pct(t, vmid, "set", *[arg for k, v in options.items() for arg in (f"--{k}", v)])


def ct_exec(
    t: Transport,
    vmid: int | str,
    argv: Sequence[str],
    *,
    timeout: float | None = 60.0,
    input: str | None = None,
    env: Mapping[str, str] | None = None,
) -> Result:
    """Run argv inside the CT (`pct exec <vmid> -- argv`): the command's own Result.

    env crosses into the CT on stdin (pct exec would not carry the host's environment in,
    and a command line would expose it). DdopsError when pct itself fails (CT absent or
    not running)."""
    vmid = validate_vmid(vmid)
    inner, stdin = env_via_stdin(argv, env, input) if env else (list(argv), input)
    r = t.run(["pct", "exec", vmid, "--", *inner], timeout=timeout, input=stdin)
    r = dataclasses.replace(r, argv=("pct", "exec", vmid, "--", *argv))  # without the wrapper
    if r.rc == PCT_TASK_ERROR and _pct_refused_exec(r.stderr, vmid):
        _checked(r, vmid)
    return r


def ct_push(t: Transport, vmid: int | str, src: str, dst: str, *, perms: int = 0o644) -> None:
    """Copy the host file `src` to `dst` inside the running CT with mode `perms`."""
    vmid = validate_vmid(vmid)
    src, dst = validate_host_path(src), validate_host_path(dst)
    _pct(t, vmid, "push", src, dst, "--perms", f"{perms:04o}")


# -- the pct call and its errors ---------------------------------------------------------------
def _transition(
    t: Transport,
    vmid: int | str,
    action: str,
    wanted: str,
    options: Sequence[str] = (),
    *,
    timeout: float,
) -> bool:
    vmid = validate_vmid(vmid)
    status = ct_status(t, vmid)
    if status is None:
        raise DdopsError(f"CT {vmid}", f"does not exist (no /etc/pve/lxc/{vmid}.conf)")
    if status == wanted:
        return False
    _pct(t, vmid, action, *options, timeout=timeout)
    return True


def _pct(t: Transport, vmid: str, action: str, *args: str, timeout: float = 60.0) -> Result:
    return _checked(t.run(["pct", action, vmid, *args], timeout=timeout), vmid)


def _checked(r: Result, vmid: str) -> Result:
    """r when pct succeeded; else DdopsError, clearest for a missing or locked CT."""
    if r.ok:
        return r
    obj = f"CT {vmid}"
    if _MISSING_CT.search(r.stderr):
        raise DdopsError(obj, f"does not exist (no /etc/pve/lxc/{vmid}.conf)")
    if locked := _LOCKED.search(r.stderr):
        raise DdopsError(
            obj,
            f"locked ({locked[1]}): `pct {r.argv[1]}` refused; once the {locked[1]} is over, "
            f"clear it with `pct unlock {vmid}`",
        )
    return r.check(obj)


def _pct_refused_exec(stderr: str, vmid: str) -> bool:
    """Whether pct itself (not the command inside) failed the exec."""
    lines = stderr.strip().splitlines()
    return bool(lines) and (
        lines[-1] == f"CT {vmid} not running" or bool(_MISSING_CT.search(lines[-1]))
    )
