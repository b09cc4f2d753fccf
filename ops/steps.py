"""Run a list of steps (read facts, plan, apply, verify) and report each as changed/unchanged/failed.

A step is a plain function `step(dry_run: bool) -> Outcome`; it raises DdopsError when it
fails. `run_steps` times each, stops at the first failure (the rest are reported skipped), and
returns StepResults that `render_table` prints for people and `results_json` for machines.

    results = run_steps([("host: gpu nodes", lambda d: ensure_nodes(t, d)), ...], dry_run=False)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from rich.console import Console
from rich.table import Table

from ops.errors import DdopsError

CHANGED, UNCHANGED, WOULD_CHANGE, FAILED, SKIPPED = (
    "changed",
    "unchanged",
    "would change",
    "failed",
    "skipped",
)


@dataclass(frozen=True)
class Outcome:
    """What a step found or did. `diff` is shown with --dry-run."""

    changed: bool
    detail: str = ""
    diff: str = ""


@dataclass(frozen=True)
class StepResult:
    step: str
    status: str
    seconds: float
    detail: str = ""
    diff: str = ""

    @property
    def failed(self) -> bool:
        return self.status == FAILED


StepFn = Callable[[bool], Outcome]


def run_steps(
    steps: Sequence[tuple[str, StepFn]],
    *,
    dry_run: bool = False,
    on_result: Callable[[StepResult], None] | None = None,
) -> list[StepResult]:
    """Run steps in order; after a failure the remaining steps are reported as skipped."""
    results: list[StepResult] = []
    failed = False
    for name, fn in steps:
        if failed:
            result = StepResult(name, SKIPPED, 0.0, "an earlier step failed")
        else:
            start = time.monotonic()
            try:
                outcome = fn(dry_run)
                status = (WOULD_CHANGE if dry_run else CHANGED) if outcome.changed else UNCHANGED
                result = StepResult(
                    name, status, time.monotonic() - start, outcome.detail, outcome.diff
                )
            except DdopsError as exc:
                failed = True
                result = StepResult(name, FAILED, time.monotonic() - start, str(exc))
        results.append(result)
        if on_result:
            on_result(result)
    return results


def first_failure(results: Sequence[StepResult]) -> StepResult | None:
    return next((r for r in results if r.failed), None)


STYLE = {
    CHANGED: "yellow",
    UNCHANGED: "green",
    WOULD_CHANGE: "cyan",
    FAILED: "bold red",
    SKIPPED: "dim",
}


def render_table(title: str, results: Sequence[StepResult], console: Console | None = None) -> None:
    """A table of steps for people (diffs follow the table on --dry-run)."""
    console = console or Console()
    table = Table(title=title, title_justify="left")
    for column in ("step", "status", "time", "detail"):
        table.add_column(column, no_wrap=column != "detail")
    for r in results:
        table.add_row(r.step, f"[{STYLE[r.status]}]{r.status}[/]", f"{r.seconds:.2f}s", r.detail)
    console.print(table)
    for r in results:
        if r.diff:
            console.print(r.diff, markup=False, highlight=False)


def results_json(results: Sequence[StepResult]) -> list[dict]:
    return [asdict(r) for r in results]
