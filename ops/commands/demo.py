"""`ddops demo`: the whole lifecycle on a simulated Proxmox host with the demo model on CPU.

    ddops demo                      # WORKDIR defaults to <ddops home>/demo
    ddops demo --workdir /tmp/demo
    ddops --json demo               # stage output to stderr, one JSON document on stdout

Ends with the bench table (ar vs DFlash chain vs DDTree budget 15) and where the report is.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import click

from ops.demo import run_demo, summary_lines


def default_workdir() -> Path:
    home = os.environ.get("DDOPS_HOME") or click.get_app_dir("ddops")
    return Path(home) / "demo"


def _invoke_ddops(argv: Sequence[str]) -> int:
    """Run one `ddops` command in this process; its exit code."""
    from ops.cli import cli

    code = cli.main(list(argv), prog_name="ddops", standalone_mode=False)
    return code if isinstance(code, int) else 0


@click.command("demo")
@click.option(
    "--workdir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Where the sim host, hub, results and report go (default: <ddops home>/demo).",
)
@click.pass_context
def demo_command(ctx: click.Context, workdir: Path | None) -> None:
    """Provision, reboot, recover and bench a simulated Proxmox host, on CPU."""
    result = run_demo(workdir or default_workdir(), _invoke_ddops, quiet_stdout=ctx.obj.json)
    if ctx.obj.json:
        document = {
            "workdir": str(result.workdir),
            "stages": [asdict(s) for s in result.stages],
            "report": str(result.report) if result.report else None,
        }
        click.echo(json.dumps(document, indent=1))
    else:
        click.echo("\n".join(summary_lines(result)))
