"""`ddops recover`: diagnose and repair GPU containers in chain order (see ops/checks.py).

    ddops -i site.yml recover --ct 200            # probe, repair what fails, re-probe
    ddops -i site.yml recover --ct 200 --dry-run  # what would be done, with file diffs
    ddops -i site.yml recover --ct 200 --unlock   # also clear a CT lock (lock: backup, ...)
    ddops --host sim:/tmp/pve1 --json recover --ct 200

Exit 0 only when every CT ends healthy. Each run records what it did on the host
(/var/lib/ddops/last-recover/<vmid>.json), which `ddops health` shows. `run_chain_command` is
shared with `health` and `provision`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import click

from ops import last_recover
from ops.checks import ChainContext, Policy
from ops.output import chain_output
from ops.provision import provision
from ops.recover import ChainReport, contexts, health, recover, reports_json
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
    trigger: str = "manual",
) -> None:
    """Resolve the site, run the chain per CT, report as it goes (a live line on a terminal,
    plain lines in a pipe) then a summary (or --json); when a check failed, its cause as one
    `Error:` line on stderr and exit 1. `api_key`: provision's key to install; `trigger`: why a
    recover runs (its record says "manual" or "boot")."""
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
        output = None if app.json else chain_output()
        reports = []
        try:
            for c in contexts(opened, policy, api_key):
                if output:
                    output.start(c, mode)
                reports.append(_run(c, mode, dry_run, trigger, output.result if output else None))
        finally:  # a live line never outlives an error
            if output:
                output.stop()
    if output:
        output.finish(reports)
    else:
        click.echo(json.dumps(reports_json(reports), indent=2))
    if failure := _first_failure(reports):
        click.echo(f"Error: {failure}", err=True)
        ctx.exit(1)


def _run(c: ChainContext, mode: str, dry_run: bool, trigger: str, on_result) -> ChainReport:
    """One CT's chain in `mode`; a recover leaves its record on the host, health shows it."""
    if mode == "health":
        report = health(c, on_result=on_result)
        report.last_recover = last_recover.read(c.t, c.vmid)
    elif mode == "provision":
        report = provision(c, dry_run=dry_run, on_result=on_result)
    else:
        report = recover(c, dry_run=dry_run, on_result=on_result)
        if not dry_run and report.results and report.results[0].status != FAILED:
            last_recover.record(c.t, report, trigger)
    return report


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
@click.option(
    "--at-boot",
    is_flag=True,
    help="Record this run as the boot-time recovery (ddops-recover.service passes it).",
)
@VIA
@click.pass_context
def recover_command(
    ctx: click.Context, vmids: tuple[int, ...], dry_run: bool, unlock: bool, at_boot: bool, via: str
) -> None:
    """Repair GPU containers after reboots and faults: probe, remedy, re-probe, in chain order.
    Each run leaves its record on the host; `ddops health` shows the last one."""
    trigger = "boot" if at_boot else "manual"
    run_chain_command(ctx, "recover", vmids, Policy(unlock=unlock), dry_run, via, trigger=trigger)
