"""Run the chain (ops/chain/checks.py) over one container: probe only (health), or repair in order.

    report = health(ctx)                  # every probe, read-only; dependents of a failure skipped
    report = recover(ctx, dry_run=False)  # probe, remedy if failing, re-probe; stop at the first
                                          # failure nothing can fix; under the host lock
    reports_json([report])                # one document for --json

Concurrent repairs of one host are serialised by the host lock (ops/chain/lock.py: flock on
/run/lock/ddops/recover.lock through the transport, its holder recorded): the second waits, then
finds nothing to do. `ddops provision` is the same run under the provision policy.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from dataclasses import asdict

from ops.chain.checks import ChainContext, Check, Finding, Policy, chain_for, probe_host
from ops.chain.lock import host_lock
from ops.chain.report import (
    CHANGED,
    FAILED,
    OK,
    SKIPPED,
    UNCHANGED,
    WOULD_CHANGE,
    ChainReport,
    CheckResult,
    Mode,
)
from ops.errors import DdopsError
from ops.site.selection import OpenedSite, results_dir


def _probe(check: Check, c: ChainContext) -> Finding:
    """The probe's finding; a probe that cannot read its facts is a failure nothing can fix."""
    try:
        return check.probe(c)
    except DdopsError as exc:
        return Finding(False, str(exc), fixable=False)


def _unfixable_reason(check: Check, c: ChainContext, finding: Finding) -> str | None:
    if not finding.fixable or check.remedy is None:
        return finding.evidence
    if check.remedy_needs_provision and not c.policy.provision:
        return f"{finding.evidence}: `ddops provision --ct {c.vmid}` creates it"
    return None


def _repair(check: Check, c: ChainContext, finding: Finding, dry_run: bool) -> CheckResult:
    """Apply the check's remedy and re-probe: changed (fixed), would change, or failed."""
    start = time.monotonic()

    def result(status: str, action: str = "", diff: str = "") -> CheckResult:
        seconds = time.monotonic() - start
        return CheckResult(check.key, check.title, status, seconds, finding.evidence, action, diff)

    if (reason := _unfixable_reason(check, c, finding)) is not None:
        return CheckResult(check.key, check.title, FAILED, 0.0, reason)
    try:
        outcome = check.remedy(c, dry_run)
    except DdopsError as exc:
        return result(FAILED, str(exc))
    if dry_run:
        return result(WOULD_CHANGE, outcome.detail, outcome.diff)
    after = _probe(check, c)
    if after.ok:
        return result(CHANGED, outcome.detail, outcome.diff)
    return result(FAILED, f"{outcome.detail}; still failing: {after.evidence}", outcome.diff)


def run_check(check: Check, c: ChainContext, *, repair: bool, dry_run: bool = False) -> CheckResult:
    """One check: probe; when it fails and `repair`, remedy and re-probe (time: all of it)."""
    start = time.monotonic()
    finding = _probe(check, c)
    if finding.ok:
        status = UNCHANGED if repair else OK
    elif repair:
        result = _repair(check, c, finding, dry_run)
        return _with_probe_time(result, time.monotonic() - start)
    else:
        status = FAILED
    return CheckResult(check.key, check.title, status, time.monotonic() - start, finding.evidence)


def run_chain(
    c: ChainContext,
    *,
    mode: Mode,
    dry_run: bool = False,
    on_result: Callable[[CheckResult], None] | None = None,
) -> ChainReport:
    """Go through the chain for `c.policy`. mode "health" only probes (a check whose prerequisite
    failed is skipped); "recover" and "provision" repair in order and stop at the first failure
    nothing fixes."""
    if mode == "provision":  # the one place the mode sets the policy
        c = dataclasses.replace(c, policy=dataclasses.replace(c.policy, provision=True))
    repair = mode != "health"
    report = ChainReport(c.t.label, c.vmid, mode, dry_run)
    start = time.monotonic()
    not_ok: set[str] = set()
    stopped = False
    for check in chain_for(c.policy):
        missing = [need for need in check.needs if need in not_ok]
        if stopped or missing:
            why = "an earlier check failed" if stopped else f"needs {', '.join(missing)}"
            result = CheckResult(check.key, check.title, SKIPPED, 0.0, why)
        else:
            result = run_check(check, c, repair=repair, dry_run=dry_run)
        if result.status not in (OK, UNCHANGED, CHANGED):
            not_ok.add(check.key)
        stopped = stopped or (repair and result.status == FAILED)
        report.results.append(result)
        if on_result:
            on_result(result)
    report.seconds = time.monotonic() - start
    return report


def _with_probe_time(result: CheckResult, seconds: float) -> CheckResult:
    return CheckResult(**{**asdict(result), "seconds": seconds})


def health(c: ChainContext, on_result: Callable[[CheckResult], None] | None = None) -> ChainReport:
    """Every probe, read-only."""
    return run_chain(c, mode="health", on_result=on_result)


def recover(
    c: ChainContext,
    *,
    dry_run: bool = False,
    mode: Mode = "recover",
    on_result: Callable[[CheckResult], None] | None = None,
) -> ChainReport:
    """Repair the CT in chain order under the host lock. A dry run changes nothing and an
    unreachable host cannot be locked: both run without it (the latter fails its first check)."""
    if dry_run or not _reachable(c):
        return run_chain(c, mode=mode, dry_run=dry_run, on_result=on_result)
    with host_lock(c.t):
        return run_chain(c, mode=mode, on_result=on_result)


def provision(
    c: ChainContext,
    *,
    dry_run: bool = False,
    on_result: Callable[[CheckResult], None] | None = None,
) -> ChainReport:
    """Bring the CT from whatever it is to healthy, creating what is missing; `on_result` sees
    each check as it finishes."""
    return recover(c, dry_run=dry_run, mode="provision", on_result=on_result)


def _reachable(c: ChainContext) -> bool:
    try:
        return probe_host(c).ok
    except DdopsError:
        return False


def contexts(opened: OpenedSite, policy: Policy, api_key: str | None = None) -> list[ChainContext]:
    """One ChainContext per selected CT; HF_TOKEN from the environment (never logged); `api_key`
    is the operator's key for provision to install (never logged)."""
    return [
        ChainContext(
            t=target.t,
            ct=target.ct,
            model=opened.site.model,
            engine=opened.site.engine,
            policy=policy,
            host=target.host,
            results_dir=results_dir(),
            hf_token=os.environ.get("HF_TOKEN") or None,
            api_key=api_key,
        )
        for target in opened.targets
    ]
