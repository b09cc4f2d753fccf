"""The chain's vocabulary of results: a check's status and outcome, a CT's report, the JSON.

    Outcome(changed=True, detail="wrote /etc/pve/lxc/200.conf", diff=...)   # what a remedy did
    CheckResult(key, title, status, seconds, evidence, action, diff)       # one check in a run
    ChainReport(host, vmid, mode, ...)                                     # one CT's run
    reports_json([report])                                                 # one document for --json

`Mode` is the one type of a run: "health" probes, "recover" repairs, "provision" repairs and
creates what is missing; a run's Policy (ops/chain/checks.py) carries it, set by
ops.chain.runner.chain_run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Literal

Mode = Literal["health", "recover", "provision"]

CHANGED, UNCHANGED, WOULD_CHANGE, FAILED, SKIPPED = (
    "changed",
    "unchanged",
    "would change",
    "failed",
    "skipped",
)


@dataclass(frozen=True)
class Outcome:
    """What a remedy found or did. `diff` is shown with --dry-run."""

    changed: bool
    detail: str = ""
    diff: str = ""


OK = "ok"  # health's word for a passing probe (a repair run says "unchanged")


@dataclass(frozen=True)
class CheckResult:
    """One check in a run: what the probe found (evidence), what was done (action), how long."""

    key: str
    title: str
    status: str  # ok | unchanged | changed | would change | failed | skipped
    seconds: float
    evidence: str = ""
    action: str = ""
    diff: str = ""


@dataclass
class ChainReport:
    host: str
    vmid: int
    mode: Mode
    dry_run: bool = False
    results: list[CheckResult] = field(default_factory=list)
    seconds: float = 0.0
    last_recover: dict | None = (
        None  # health: the CT's last recover record (ops/chain/last_recover.py)
    )

    @property
    def ok(self) -> bool:
        """Every check passed (or was repaired); a dry run that would change something is not ok."""
        return all(r.status in (OK, UNCHANGED, CHANGED) for r in self.results)

    def to_json(self) -> dict:
        return {
            "host": self.host,
            "ct": self.vmid,
            "mode": self.mode,
            "dry_run": self.dry_run,
            "ok": self.ok,
            "seconds": round(self.seconds, 3),
            "checks": [asdict(r) for r in self.results],
            **({"last_recover": self.last_recover} if self.last_recover else {}),
        }


STYLE = {
    CHANGED: "yellow",
    UNCHANGED: "green",
    WOULD_CHANGE: "cyan",
    FAILED: "bold red",
    SKIPPED: "dim",
}


def reports_json(reports: Sequence[ChainReport]) -> dict:
    return {"ok": all(r.ok for r in reports), "cts": [r.to_json() for r in reports]}
