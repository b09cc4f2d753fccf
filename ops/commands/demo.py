"""`ddops demo`: the whole lifecycle on a simulated Proxmox host with the demo model on CPU.

    ddops demo                      # WORKDIR defaults to <ddops home>/demo
    ddops demo --workdir /tmp/demo
    ddops --json demo               # stage output to stderr, one JSON document on stdout

One screen: a line per stage, what the boot-time recovery repaired after the reboot, the bench
table (ar vs DFlash chain vs DDTree at budgets 4-32) with the winner, and where the report is.
On a terminal a live line shows the running stage; in a pipe each stage's line prints as it ends.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import click
from rich.console import Console

from ops.demo_story import HEADER, DemoResult, Stage, run_demo, stage_line, story_lines


def default_workdir() -> Path:
    home = os.environ.get("DDOPS_HOME") or click.get_app_dir("ddops")
    return Path(home) / "demo"


def _invoker(root: click.Command) -> Callable[[Sequence[str]], int]:
    """Run one `ddops` command in this process through `root`, the group running the demo (so
    the demo needs no import of ops.cli); its exit code."""

    def invoke(argv: Sequence[str]) -> int:
        code = root.main(list(argv), prog_name="ddops", standalone_mode=False)
        return code if isinstance(code, int) else 0

    return invoke


class DemoProgress:
    """A live line on a terminal (stderr) while a stage runs; in a pipe, each stage's line as it
    ends. With -v, every check of the chain stages too."""

    def __init__(self, verbose: bool, quiet: bool) -> None:
        self.stderr = Console(stderr=True)
        self.live = self.stderr.is_terminal and not quiet
        self.plain = not self.live and not quiet
        self.verbose, self._status, self._count = verbose and not quiet, None, 0

    def __call__(self, stage: Stage, done: bool) -> None:
        if not done:
            self._count += 1
            if self.plain and self._count == 1:
                click.echo(HEADER)
            if self.live:
                self._status = self.stderr.status(f"demo, stage {self._count}: {stage.name}")
                self._status.start()
            return
        if self._status is not None:
            self._status.stop()
        if self.plain:
            click.echo(stage_line(stage))
        if self.verbose:
            from ops.chain.output import check_line
            from ops.chain.report import CheckResult

            for ct in (stage.document or {}).get("cts", []):
                for check in ct["checks"]:
                    click.echo(check_line(CheckResult(**check)), err=True)


@click.command("demo")
@click.option(
    "--workdir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Where the sim host, hub, results and report go (default: <ddops home>/demo).",
)
@click.pass_context
def demo_command(ctx: click.Context, workdir: Path | None) -> None:
    """Provision, reboot, recover and bench a simulated Proxmox host, on CPU."""
    progress = DemoProgress(verbose=ctx.obj.verbose > 0, quiet=ctx.obj.json)
    invoke = _invoker(ctx.find_root().command)
    result = run_demo(workdir or default_workdir(), invoke, progress)
    if ctx.obj.json:
        click.echo(json.dumps(_document(result), indent=1))
        return
    lines = story_lines(result)
    if progress.plain:  # the header and the stage lines were printed as the stages ended
        printed = {HEADER, *(stage_line(s) for s in result.stages)}
        lines = [line for line in lines if line not in printed]
    click.echo("\n".join(lines))


def _document(result: DemoResult) -> dict:
    return {
        "workdir": str(result.workdir),
        "stages": [
            {"name": s.name, "argv": s.argv, "exit_code": s.exit_code, "seconds": s.seconds}
            for s in result.stages
        ],
        "report": str(result.report) if result.report else None,
        "agentic_report": str(result.agentic_report) if result.agentic_report else None,
    }
