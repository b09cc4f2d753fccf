"""Run the chain (ops/chain/checks.py) over one container: probe only (health), or repair in order.

    report = run_chain(c, mode="health")                   # every probe, read-only; dependents
                                                           # of a failure skipped
    report = run_chain(c, mode="recover", unlock=True)     # probe, remedy if failing, re-probe;
                                                           # stop at the first failure nothing
                                                           # can fix; under the host lock
    report = run_chain(c, mode="provision", dry_run=True)  # also creates; plans only here
    with chain_run(c, "recover") as c: run_check(...)      # one check (the Ansible module)
    reports_json([report])                                 # one document for --json

A run of the chain is its mode, whether it only plans (dry_run) and the CT. `chain_run` is the
one place a run is set up: it sets the CT's Policy from the mode and the run's options, and
holds the host lock while the run may change something. Concurrent repairs of one host are
serialised by that lock (ops/chain/lock.py: flock on /run/lock/ddops/recover.lock through the
transport, its holder recorded): the second waits, then finds nothing to do.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Callable, Iterator
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

OnResult = Callable[[CheckResult], None] | None


def _probe(check: Check, c: ChainContext) -> Finding:
    """The probe's finding; a probe that cannot read its facts is a failure nothing can fix."""
    try:
        return check.probe(c)
    except DdopsError as exc:
        return Finding(False, str(exc), fixable=False)


def _unfixable_reason(check: Check, c: ChainContext, finding: Finding) -> str | None:
    if not finding.fixable or check.remedy is None:
        return finding.evidence
    if check.provision_only == "remedy" and c.policy.mode != "provision":
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


@contextlib.contextmanager
def chain_run(
    c: ChainContext, mode: Mode, dry_run: bool = False, **options: bool
) -> Iterator[ChainContext]:
    """THE one place a run of the chain is set up: `c` with its Policy set from `mode` and
    `options` (Policy's other fields), under the host lock while the run may change something.
    Health and a dry run change nothing, and an unreachable host cannot be locked: those run
    without it (the latter fails its first check)."""
    c = dataclasses.replace(c, policy=Policy(mode=mode, **options))
    if mode == "health" or dry_run or not _reachable(c):
        yield c
        return
    with host_lock(c.t):
        yield c


def run_chain(
    c: ChainContext,
    *,
    mode: Mode,
    dry_run: bool = False,
    on_result: OnResult = None,
    **options: bool,
) -> ChainReport:
    """One run of the chain over `c`'s CT (chain_run sets it up). "health" only probes (a check
    whose prerequisite failed is skipped); "recover" and "provision" repair in order and stop at
    the first failure nothing fixes; `on_result` sees each check as it finishes."""
    with chain_run(c, mode, dry_run, **options) as c:
        return _go_through(c, dry_run, on_result)


def _go_through(c: ChainContext, dry_run: bool, on_result: OnResult) -> ChainReport:
    mode = c.policy.mode
    repair = mode != "health"
    report = ChainReport(c.t.label, c.vmid, mode, dry_run)
    start = time.monotonic()
    not_ok: set[str] = set()
    stopped = False
    for check in chain_for(mode):
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


def _reachable(c: ChainContext) -> bool:
    try:
        return probe_host(c).ok
    except DdopsError:
        return False


def contexts(opened: OpenedSite, api_key: str | None = None) -> list[ChainContext]:
    """One ChainContext per selected CT (its policy is the run's, set by chain_run); HF_TOKEN from
    the environment (never logged); `api_key` is the operator's key for provision to install
    (never logged)."""
    return [
        ChainContext(
            t=target.t,
            ct=target.ct,
            model=opened.site.model,
            engine=opened.site.engine,
            host=target.host,
            results_dir=results_dir(),
            hf_token=os.environ.get("HF_TOKEN") or None,
            api_key=api_key,
        )
        for target in opened.targets
    ]
