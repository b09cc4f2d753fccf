"""`ddops provision`: host GPU readiness, the CT and its GPU config, CUDA, model staging, engine.

    ddops -i site.yml provision --ct 200            # from nothing to a healthy engine
    ddops -i site.yml provision --ct 200 --dry-run  # the plan and file diffs; nothing changes
    ddops --host sim:/tmp/pve1 provision --ct 200   # the demo model pair on a sim host

Each step is reported unchanged / changed / failed with its duration; a second run changes
nothing. Exit 0 only when the CT ends healthy.
"""

from __future__ import annotations

import click

from ops.checks import Policy
from ops.commands.recover import VIA, VMID, run_chain_command


@click.command("provision")
@click.option("--ct", "vmids", type=VMID, multiple=True, help="The CT (repeat; default: all).")
@click.option("--dry-run", is_flag=True, help="Print the plan and file diffs; change nothing.")
@VIA
@click.pass_context
def provision_command(ctx: click.Context, vmids: tuple[int, ...], dry_run: bool, via: str) -> None:
    """Set up GPU containers from the inventory and bring their engines up."""
    run_chain_command(ctx, "provision", vmids, Policy(provision=True), dry_run, via)
