"""How the chain commands (health, recover, provision) talk to people.

On a terminal: one live line on stderr while the checks run (transient), then one table per CT.
In a pipe or a CI log: plain lines, no box drawing: a header per CT, a line per check as it
finishes, then a verdict line per CT. `--json` prints neither (one document at the end).

    out = chain_output()              # live on a terminal, plain elsewhere
    out.start(c, "provision")         # before a CT's chain
    out.result(result)                # each check as it finishes (the runner's on_result)
    out.stop()                        # the live line ends (also on an error)
    out.finish(reports)               # the summary
"""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ops.chain.last_recover import describe
from ops.chain.report import OK, STYLE, ChainReport, CheckResult, Mode

_STATUS_STYLE = {**STYLE, OK: "green"}


def verdict(report: ChainReport) -> str:
    """ "healthy" / "NOT healthy"; for a dry run "nothing to do" / "changes planned"."""
    if report.dry_run:
        return "nothing to do" if report.ok else "changes planned"
    return "healthy" if report.ok else "NOT healthy"


def render_reports(reports: Sequence[ChainReport], console: Console | None = None) -> None:
    """One table per CT: check, status, time, and what was found / done; then file diffs."""
    console = console or Console()
    for report in reports:
        title = f"{report.mode}: CT {report.vmid} on {report.host}: {verdict(report)}"
        table = Table(title=f"{title} ({report.seconds:.1f}s)", title_justify="left")
        for column in ("check", "status", "time", "found / done"):
            wrap = column == "found / done"
            table.add_column(column, no_wrap=not wrap, overflow="fold" if wrap else "ellipsis")
        for r in report.results:
            said = escape(r.evidence if not r.action else f"{r.evidence}\n-> {r.action}")
            style = _STATUS_STYLE[r.status]
            table.add_row(r.title, f"[{style}]{r.status}[/]", f"{r.seconds:.2f}s", said)
        console.print(table)
        _print_diffs(report, console)
        if report.last_recover:
            console.print(describe(report.last_recover), markup=False, highlight=False)


def _print_diffs(report: ChainReport, console: Console) -> None:
    for r in report.results:
        if r.diff:
            console.print(r.diff, markup=False, highlight=False, soft_wrap=True)


def check_line(result: CheckResult) -> str:
    """One plain line: status, title, time, what was found and what was done."""
    said = result.evidence + (f" -> {result.action}" if result.action else "")
    return f"  {result.status:<12} {result.title:<35} {result.seconds:5.1f}s  {said}"


class PlainChainOutput:
    """Plain lines on stdout: the checks as they finish are the report; a verdict per CT."""

    def __init__(self, console: Console) -> None:
        self.console = console

    def start(self, c, mode: Mode) -> None:
        self.console.print(f"{mode} {c.name} on {c.t.label}", markup=False, highlight=False)

    def result(self, result: CheckResult) -> None:
        self.console.print(check_line(result), markup=False, highlight=False, soft_wrap=True)

    def stop(self) -> None:
        """Nothing is live in a pipe."""

    def finish(self, reports: Sequence[ChainReport]) -> None:
        for report in reports:
            _print_diffs(report, self.console)
            line = f"{report.mode}: CT {report.vmid} on {report.host}: {verdict(report)}"
            self.console.print(f"{line} ({report.seconds:.1f}s)", markup=False, highlight=False)
            if report.last_recover:
                self.console.print(describe(report.last_recover), markup=False, highlight=False)


class LiveChainOutput:
    """A transient status line on stderr while a CT's chain runs; the tables at the end."""

    def __init__(self, console: Console, stderr: Console) -> None:
        self.console, self.stderr = console, stderr
        self._status = None
        self._title = ""
        self._done = 0

    def start(self, c, mode: Mode) -> None:
        self.stop()
        self._title, self._done = f"{mode} {c.name} on {c.t.label}", 0
        self._status = self.stderr.status(f"{self._title}: starting")
        self._status.start()

    def result(self, result: CheckResult) -> None:
        self._done += 1
        if self._status is not None:
            self._status.update(
                f"{self._title}: {self._done} checks done; {result.title}: {result.status}"
            )

    def finish(self, reports: Sequence[ChainReport]) -> None:
        self.stop()
        render_reports(reports, self.console)

    def stop(self) -> None:
        if self._status is not None:
            self._status.stop()
            self._status = None


def chain_output(
    console: Console | None = None, stderr: Console | None = None
) -> PlainChainOutput | LiveChainOutput:
    console = console or Console()
    if console.is_terminal:
        return LiveChainOutput(console, stderr or Console(stderr=True))
    return PlainChainOutput(console)
