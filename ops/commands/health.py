"""`ddops health`: every check of the chain (ops/chain/checks.py), read-only.

    ddops -i site.yml health --ct 200
    ddops --host sim:/tmp/pve1 --json health --ct 200

Exit 0 only when every check passes; a check whose prerequisite failed is "skipped (needs X)".
The staged model is checked by size and mtime against its stamp; `--hashes` reads every byte
and compares sha256 too (minutes for a 54 GB model).
"""

from __future__ import annotations

import click

from ops.commands.shared import VMID, run_chain_command


@click.command("health")
@click.option("--ct", "vmids", type=VMID, multiple=True, help="The CT (repeat; default: all).")
@click.option("--hashes", is_flag=True, help="Also verify the staged model's sha256 (slow).")
@click.pass_context
def health_command(ctx: click.Context, vmids: tuple[int, ...], hashes: bool) -> None:
    """Probe every check of the chain for the CTs, changing nothing."""
    run_chain_command(ctx, "health", vmids, verify_hashes=hashes)
