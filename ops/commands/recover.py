"""`ddops recover`: diagnose and repair GPU containers in chain order (see ops/checks.py).

    ddops -i site.yml recover --ct 200            # probe, repair what fails, re-probe
    ddops -i site.yml recover --ct 200 --dry-run  # what would be done, with file diffs
    ddops -i site.yml recover --ct 200 --unlock   # also clear a CT lock (lock: backup, ...)
    ddops --host sim:/tmp/pve1 --json recover --ct 200

Exit 0 only when every CT ends healthy. `run_chain_command` is shared with `health` and
`provision`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import click

from ops.checks import Policy
from ops.provision import provision
from ops.recover import (
    ChainReport,
    CheckResult,
    contexts,
    health,
    recover,
    render_reports,
    reports_json,
)
from ops.site import open_site
from ops.steps import FAILED

VMID = click.IntRange(100, 999_999_999)
VIA = click.option(
    "--via",
    type=click.Choice(["direct", "ansible"]),
    default="direct",
    show_default=True,
    help="direct: ddops acts itself; ansible: through playbooks/ with ansible-runner.",
)


def run_chain_command(
    ctx: click.Context,
    mode: str,
    vmids: Sequence[int],
    policy: Policy,
    dry_run: bool = False,
    via: str = "direct",
    api_key: str | None = None,
) -> None:
    """Resolve the site, run the chain per CT, print a table (or --json); when a check failed,
    its cause as one `Error:` line on stderr and exit 1. `api_key`: provision's key to install."""
    app = ctx.obj
    with open_site(
        inventory=app.inventory,
        host=app.host,
        vmids=vmids,
        accept_new_host_key=app.accept_new_host_key,
    ) as opened:
        if via == "ansible":
            from ops.commands.via_ansible import chain_via_ansible

            return chain_via_ansible(ctx, opened, mode, policy, dry_run)
        progress = None if app.json else _progress
        reports = []
        for c in contexts(opened, policy, api_key):
            if mode == "health":
                reports.append(health(c, on_result=progress))
            elif mode == "provision":
                reports.append(provision(c, dry_run=dry_run, on_result=progress))
            else:
                reports.append(recover(c, dry_run=dry_run, on_result=progress))
    if app.json:
        click.echo(json.dumps(reports_json(reports), indent=2))
    else:
        render_reports(reports)
    if failure := _first_failure(reports):
        click.echo(f"Error: {failure}", err=True)
        ctx.exit(1)


def _progress(result: CheckResult) -> None:
    """One line per check as it finishes (stderr), so a long provision shows where it is."""
    click.echo(f"{result.status:>12}  {result.title} ({result.seconds:.1f}s)", err=True)


def _first_failure(reports: Sequence[ChainReport]) -> str | None:
    """The cause of the first failed check (what its remedy said, else what its probe found);
    None when nothing failed (a dry run that only plans changes succeeds)."""
    failed = (r for report in reports for r in report.results if r.status == FAILED)
    first = next(failed, None)
    return (first.action or first.evidence) if first else None


@click.command("recover")
@click.option("--ct", "vmids", type=VMID, multiple=True, help="The CT (repeat; default: all).")
@click.option("--dry-run", is_flag=True, help="Show what would be done; change nothing.")
@click.option("--unlock", is_flag=True, help="Clear a CT lock (pct unlock) before starting it.")
@VIA
@click.pass_context
def recover_command(
    ctx: click.Context, vmids: tuple[int, ...], dry_run: bool, unlock: bool, via: str
) -> None:
    """Repair GPU containers after reboots and faults: probe, remedy, re-probe, in chain order."""
    run_chain_command(ctx, "recover", vmids, Policy(unlock=unlock), dry_run, via)
