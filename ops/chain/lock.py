"""The host lock: one ddops repair at a time per host (recover, provision, the boot unit, Ansible).

    with host_lock(t):          # waits for another holder, up to LOCK_TIMEOUT_S
        ...                     # repair

The lock is flock(2) on /run/lock/ddops/recover.lock through the transport (ops/host/transport.py:
held by this process locally, by a remote flock(1) tied to the SSH connection otherwise), so it
ends with its holder: after a crash, the next run takes it at once instead of waiting out a
timeout. While held, recover.owner beside it records the holder (host, pid, time): a waiter
that gives up names it, and a record left behind (its owner died holding the lock) is broken
with a warning when the next run takes the lock. A live holder is never broken: two repairs
of one CT config at once is what the lock prevents.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass

from ops.errors import DdopsError
from ops.host.transport import LockTimeout, Transport

LOCK_PATH = "/run/lock/ddops/recover.lock"
OWNER_PATH = "/run/lock/ddops/recover.owner"  # beside the lock: rewriting the lock file itself
# would give it a new inode, and a newcomer would lock that one
LOCK_TIMEOUT_S = 1800.0
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Owner:
    """Who holds the lock: the machine ddops runs on, its pid, since when (Unix time)."""

    host: str
    pid: int
    since: float

    def __str__(self) -> str:
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.since))
        return f"ddops pid {self.pid} on {self.host} (since {when})"


def host_lock_owner(t: Transport) -> Owner | None:
    """The recorded holder, or None (free, released cleanly, or a record that is not ours)."""
    try:
        data = json.loads(t.read_file(OWNER_PATH) or b"null")
        return Owner(str(data["host"]), int(data["pid"]), float(data["since"]))
    except (FileNotFoundError, ValueError, TypeError, KeyError):
        return None


@contextlib.contextmanager
def host_lock(t: Transport, timeout: float = LOCK_TIMEOUT_S) -> Iterator[None]:
    """Hold the host's repair lock; DdopsError naming the holder after `timeout` seconds."""
    try:
        with t.flock(LOCK_PATH, timeout):
            if (left := host_lock_owner(t)) is not None:
                log.warning(
                    "%s: broke the stale lock %s of %s: its owner ended without releasing it",
                    t.label,
                    LOCK_PATH,
                    left,
                )
            me = Owner(socket.gethostname(), os.getpid(), time.time())
            t.write_file(OWNER_PATH, json.dumps(asdict(me)), backup=False)
            try:
                yield
            finally:
                # best effort: a record left (the connection just died) is broken next time
                with contextlib.suppress(DdopsError, OSError):
                    t.write_file(OWNER_PATH, "", backup=False)
    except LockTimeout as exc:
        holder = host_lock_owner(t) or "another ddops"
        raise DdopsError(
            t.label, f"{holder} holds {LOCK_PATH}; gave up after {timeout:g}s"
        ) from exc
