"""`ddops provision`'s library half: the chain (ops/checks.py) under the provision policy.

    report = provision(ctx)            # under the provision policy, whatever ctx.policy says
    report = provision(ctx, dry_run=True)  # the plan and file diffs; nothing changes

The provision policy adds the checks only provision runs (memory capacity, recovery at boot,
engine installed) and lets the chain create the CT (`pct create` from the inventory). Every
check reports unchanged / changed / failed with its duration; a second run is all unchanged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from ops.checks import ChainContext
from ops.recover import ChainReport, CheckResult, recover


def provision(
    c: ChainContext,
    *,
    dry_run: bool = False,
    on_result: Callable[[CheckResult], None] | None = None,
) -> ChainReport:
    """Bring the CT from whatever it is to healthy, creating what is missing; `on_result` sees
    each check as it finishes."""
    c = dataclasses.replace(c, policy=dataclasses.replace(c.policy, provision=True))
    return recover(c, dry_run=dry_run, mode="provision", on_result=on_result)
