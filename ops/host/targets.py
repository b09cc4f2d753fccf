"""Host targets: the `--host` strings of the CLI and inventories, turned into Transports.

    open_transport("local")                              # this machine
    open_transport("sim:/tmp/pve1")                      # a simulated Proxmox host (ops/sim)
    open_transport("ssh://root@pve1.example.org:2222")   # a real host over SSH
    open_transport("ssh://pve1?sysroot=/tmp/pve1")       # a simulated host on a machine over SSH

`parse_target` is the pure half (tested in tests/ops/host/test_targets.py); `open_transport` builds the
transport without connecting (SSH connects on first use).
"""

from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit

from ops.errors import DdopsError, InputError
from ops.host.transport import LocalTransport, Transport, validate_host_path

ACCEPTED_FORMS = "local, sim:PATH, ssh://[user@]host[:port][?sysroot=/path]"
_HOST_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")
_USER = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,31}")


@dataclass(frozen=True)
class Target:
    """A parsed host target. kind: "local" | "sim" | "ssh"."""

    kind: str
    host: str | None = None
    port: int = 22
    user: str = "root"  # Proxmox: only root@pam may set devN entries and hookscripts
    sysroot: str | None = None


def parse_target(target: str) -> Target:
    """Parse a host target string, or InputError naming the accepted forms."""
    parse_target_syntax(target)
    if target.startswith("sim:"):
        return Target("sim", sysroot=_sim_root(target.removeprefix("sim:")))
    if target.startswith("ssh://"):
        return _parse_ssh(target)
    return Target("local")


def parse_target_syntax(target: str) -> str:
    """The target when it is well formed (a sim:PATH need not exist yet), else InputError; the
    message never shows a password the string may carry."""
    if target == "local":
        return target
    if target == "sim:":
        raise InputError("host 'sim:'", "a simulated host needs a path: sim:PATH")
    if target.startswith("sim:") and target.isprintable():
        return target
    if target.startswith("ssh://"):
        _parse_ssh(target)
        return target
    raise InputError(
        f"host {shown_target(target)}", f"unknown target; accepted forms: {ACCEPTED_FORMS}"
    )


def shown_target(target: str) -> str:
    """The target for a message: a password in it (ssh://user:secret@host) masked."""
    return repr(re.sub(r"^(ssh://[^/@:]*):[^/@]*@", r"\1:***@", target))


def open_transport(
    target: str,
    *,
    accept_new_host_key: bool = False,
    known_hosts: str | None = None,
    key_filename: str | None = None,
) -> Transport:
    """The Transport for a target string (SSH options apply to ssh:// targets only)."""
    parsed = parse_target(target)
    if parsed.kind != "ssh":
        return LocalTransport(sysroot=parsed.sysroot)
    # Imported here: paramiko is 0.1 s of every start of what reads targets without opening
    # one (the staging agent in a CT, three starts a boot's recover).
    from ops.host.ssh import SSHTransport

    return SSHTransport(
        parsed.host,
        port=parsed.port,
        user=parsed.user,
        sysroot=parsed.sysroot,
        key_filename=key_filename,
        known_hosts=known_hosts,
        accept_new_host_key=accept_new_host_key,
    )


def _sim_root(path: str) -> str:
    """The absolute root of a simulated host, which must exist and have etc/pve."""
    if not path:
        raise InputError("host 'sim:'", "a simulated host needs a path: sim:PATH")
    root = os.path.abspath(path)
    if not os.path.isdir(os.path.join(root, "etc/pve")):
        raise InputError(
            f"host 'sim:{path}'", f"{root} is not a simulated host (no etc/pve); ddops sim init it"
        )
    return root


def _parse_ssh(target: str) -> Target:
    obj = f"host {shown_target(target)}"
    if not target.isprintable():
        raise InputError(obj, "contains control characters (a newline?)")
    try:
        url = urlsplit(target)
        port = 22 if url.port is None else url.port
    except ValueError as exc:  # a port that is not a number, or above 65535
        raise InputError(obj, f"{exc}; accepted forms: {ACCEPTED_FORMS}") from exc
    if port == 0:
        raise InputError(obj, "port must be 1..65535")
    if url.password is not None:
        raise InputError(obj, "a password in the URL is not accepted; ddops logs in with keys")
    if url.path not in ("", "/") or url.fragment:
        raise InputError(obj, f"only user, host, port and ?sysroot=; accepted: {ACCEPTED_FORMS}")
    if not url.hostname or not valid_hostname(url.hostname):
        raise InputError(obj, f"invalid host name {url.hostname!r}")
    user = url.username if url.username is not None else "root"
    if not _USER.fullmatch(user):
        raise InputError(obj, f"invalid user name {user!r}")
    return Target("ssh", host=url.hostname, port=port, user=user, sysroot=_sysroot(obj, url.query))


def _sysroot(obj: str, query: str) -> str | None:
    if not query:
        return None
    try:
        options = parse_qs(query, strict_parsing=True)
    except ValueError as exc:
        raise InputError(obj, f"bad query {query!r}; only ?sysroot=/path") from exc
    if set(options) != {"sysroot"} or len(options["sysroot"]) != 1:
        raise InputError(obj, f"bad query {query!r}; only ?sysroot=/path")
    try:
        return validate_host_path(options["sysroot"][0])
    except DdopsError as exc:
        raise InputError(obj, str(exc)) from exc


def valid_hostname(host: str) -> bool:
    """An IP address or an RFC 1123 host name."""
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        pass
    labels = host.rstrip(".").split(".")
    return len(host) <= 253 and all(_HOST_LABEL.fullmatch(label) for label in labels)
