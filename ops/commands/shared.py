"""What the commands share: the AppContext every command gets, option types, and the chain
commands' runner (`run_chain_command`, used by health, recover and provision).

Nothing here imports ops.cli, so the commands can be imported on their own and ops/cli.py
registers them at its top.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field

import click

from ops.chain import last_recover
from ops.chain.checks import ChainContext
from ops.chain.output import chain_output
from ops.chain.report import FAILED, ChainReport, Mode, reports_json
from ops.chain.runner import contexts, run_chain
from ops.host.pve import VMID_RANGE
from ops.site.inventory import Site
from ops.site.selection import OpenedSite, open_site


@dataclass
class AppContext:
    """What every command gets: where the site is and how to talk."""

    inventory: str | None = None
    host: str | None = None
    json: bool = False
    verbose: int = 0
    accept_new_host_key: bool = False
    _closers: list = field(default_factory=list)

    def open_site(self, vmids: Sequence[int]) -> contextlib.AbstractContextManager[OpenedSite]:
        """The site the global options name (ops/site/selection.py), a simulated host's default
        site when there is no inventory."""
        return open_site(
            inventory=self.inventory,
            host=self.host,
            vmids=vmids,
            accept_new_host_key=self.accept_new_host_key,
            default_site=sim_default_site,
        )


def sim_default_site(host: str, vmids: Sequence[int]) -> Site:
    """A simulated host's default site (ops/sim/default_site.py: the sim, only for sim hosts)."""
    from ops.sim.default_site import default_site

    return default_site(host, vmids)


VMID = click.IntRange(VMID_RANGE.start, VMID_RANGE.stop - 1)
VIA = click.option(
    "--via",
    type=click.Choice(["direct", "ansible"]),
    default="direct",
    show_default=True,
    help="direct: ddops acts itself; ansible: through playbooks/ with ansible-runner.",
)


def run_chain_command(
    ctx: click.Context,
    mode: Mode,
    vmids: Sequence[int],
    dry_run: bool = False,
    via: str = "direct",
    api_key: str | None = None,
    trigger: str = "manual",
    **options: bool,
) -> None:
    """Resolve the site, run the chain per CT (ops.chain.runner.run_chain, with the run's
    `options`: Policy's fields), report as it goes (a live line on a terminal, plain lines in a
    pipe) then a summary (or --json); when a check failed, its cause as one `Error:` line on
    stderr and exit 1. `api_key`: provision's key to install; `trigger`: why a recover runs (its
    record says "manual" or "boot")."""
    app = ctx.obj
    with app.open_site(vmids) as opened:
        if via == "ansible":
            from ops.commands.via_ansible import chain_via_ansible

            return chain_via_ansible(ctx, opened, mode, dry_run, options)
        output = None if app.json else chain_output()
        reports = []
        try:
            for c in contexts(opened, api_key):
                if output:
                    output.start(c, mode)
                on_result = output.result if output else None
                reports.append(_run(c, mode, dry_run, trigger, on_result, options))
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


def _run(
    c: ChainContext, mode: Mode, dry_run: bool, trigger: str, on_result, options: dict
) -> ChainReport:
    """One CT's chain in `mode`; a recover leaves its record on the host, health shows it."""
    report = run_chain(c, mode=mode, dry_run=dry_run, on_result=on_result, **options)
    if mode == "health":
        report.last_recover = last_recover.read(c.t, c.vmid)
    elif (
        mode == "recover" and not dry_run and report.results and report.results[0].status != FAILED
    ):
        last_recover.record(c.t, report, trigger)
    return report


def _first_failure(reports: Sequence[ChainReport]) -> str | None:
    """The cause of the first failed check (what its remedy said, else what its probe found);
    None when nothing failed (a dry run that only plans changes succeeds)."""
    failed = (r for report in reports for r in report.results if r.status == FAILED)
    first = next(failed, None)
    return (first.action or first.evidence) if first else None
