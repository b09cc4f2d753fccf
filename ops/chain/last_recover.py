"""The last `ddops recover` of each CT, kept on its host, so that what an unattended recovery
(the boot unit, the hookscript) did can be read later from anywhere, by `ddops health`.

    record(t, report, trigger="boot")  # /var/lib/ddops/last-recover/<vmid>.json on the host
    last = read(t, 200)                # the record as a dict, or None
    describe(last)                     # "at boot 3 min ago: repaired CT config, ...; 14.2 s"

One file per CT (written atomically), so recoveries of two CTs never race on one file. The record
holds check titles, statuses, actions and each check's seconds (`timings`: where a boot's recovery
spent its time) only: nothing secret ever reaches a report.
"""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime

from ops.chain.report import CHANGED, FAILED
from ops.host.transport import Transport

RECORD_DIR = "/var/lib/ddops/last-recover"
TRIGGERS = ("manual", "boot")


def record_path(vmid: int) -> str:
    return f"{RECORD_DIR}/{vmid}.json"


def record(t: Transport, report, trigger: str = "manual") -> dict:
    """Write what this recover run (an ops.chain.report.ChainReport) did; the record written."""
    repaired = [
        {"key": r.key, "title": r.title, "found": r.evidence, "done": r.action}
        for r in report.results
        if r.status == CHANGED
    ]
    failed = next((r for r in report.results if r.status == FAILED), None)
    document = {
        "ct": report.vmid,
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "trigger": trigger,
        "ok": report.ok,
        "seconds": round(report.seconds, 1),
        "repaired": repaired,
        "failed": f"{failed.title}: {failed.action or failed.evidence}" if failed else None,
        "timings": {r.key: round(r.seconds, 2) for r in report.results if r.seconds >= 0.01},
    }
    t.write_file(record_path(report.vmid), json.dumps(document, indent=1) + "\n", backup=False)
    return document


def read(t: Transport, vmid: int) -> dict | None:
    """The CT's last recover record; None when it has none (or an unreadable one)."""
    if not t.exists(record_path(vmid)):
        return None
    try:
        return json.loads(t.read_text(record_path(vmid)))
    except ValueError:
        return None


def describe(last: dict, now: float | None = None) -> str:
    """One line: when and why it ran, what it repaired or why it failed, how long it took."""
    when = datetime.fromisoformat(last["when"]).timestamp()
    ago = _ago((now if now is not None else time.time()) - when)
    how = "at boot" if last["trigger"] == "boot" else "by hand"
    if last["failed"]:
        done = f"FAILED at {last['failed']}"
    elif last["repaired"]:
        done = "repaired " + ", ".join(r["title"] for r in last["repaired"])
    else:
        done = "nothing to repair"
    return f"last recover {how} {ago}: {done} ({last['seconds']:g} s)"


def _ago(seconds: float) -> str:
    seconds = max(0.0, seconds)
    for unit, size in (("day", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            count = int(seconds // size)
            return f"{count} {unit}{'s' if unit == 'day' and count > 1 else ''} ago"
    return f"{int(seconds)} s ago"
