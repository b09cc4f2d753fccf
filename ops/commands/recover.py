"""`ddops recover`: diagnose and repair GPU containers in chain order (see ops/chain/checks.py).

    ddops -i site.yml recover --ct 200            # probe, repair what fails, re-probe
    ddops -i site.yml recover --ct 200 --dry-run  # what would be done, with file diffs
    ddops -i site.yml recover --ct 200 --unlock   # also clear a CT lock (lock: backup, ...)
    ddops --host sim:/tmp/pve1 --json recover --ct 200

Exit 0 only when every CT ends healthy. Each run records what it did on the host
(/var/lib/ddops/last-recover/<vmid>.json), which `ddops health` shows. The runner it shares
with `health` and `provision` is ops/commands/shared.py's `run_chain_command`.
"""

from __future__ import annotations

import click

from ops.commands.shared import VIA, VMID, run_chain_command


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
    run_chain_command(ctx, "recover", vmids, dry_run, via, trigger=trigger, unlock=unlock)
