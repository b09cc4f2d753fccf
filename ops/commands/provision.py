"""`ddops provision`: host GPU readiness, the CT and its GPU config, CUDA, model staging, engine.

    ddops -i site.yml provision --ct 200            # from nothing to a healthy engine
    ddops -i site.yml provision --ct 200 --dry-run  # the plan and file diffs; nothing changes
    ddops --host sim:/tmp/pve1 provision --ct 200   # the demo model pair on a sim host

Each step is reported unchanged / changed / failed with its duration; a second run changes
nothing. Exit 0 only when the CT ends healthy.

The engine's API key: DDOPS_API_KEY, when set, is installed (or rotated) in the CT; without it
the installed key is kept, and a CT that has none gets a random one. `--no-api-key` removes it.
`--store-hf-token` keeps HF_TOKEN on the host (root, 0600) for the boot-time recovery.
"""

from __future__ import annotations

import os

import click

from ops.chain.deploy import API_KEY_ENV, parse_api_key
from ops.commands.shared import VIA, VMID, run_chain_command


@click.command("provision")
@click.option("--ct", "vmids", type=VMID, multiple=True, help="The CT (repeat; default: all).")
@click.option("--dry-run", is_flag=True, help="Print the plan and file diffs; change nothing.")
@click.option(
    "--store-hf-token",
    is_flag=True,
    help="Keep HF_TOKEN on the host (root, 0600) for the boot-time recovery of a gated model.",
)
@click.option(
    "--no-api-key",
    is_flag=True,
    help="Serve without authentication: remove the engine's API key (default: keep or create one).",
)
@VIA
@click.pass_context
def provision_command(
    ctx: click.Context,
    vmids: tuple[int, ...],
    dry_run: bool,
    store_hf_token: bool,
    no_api_key: bool,
    via: str,
) -> None:
    """Set up GPU containers from the inventory and bring their engines up."""
    api_key = operator_api_key()
    if api_key is not None and no_api_key:
        raise click.UsageError(f"--no-api-key and {API_KEY_ENV} contradict each other")
    if store_hf_token and not os.environ.get("HF_TOKEN"):
        raise click.UsageError("--store-hf-token needs HF_TOKEN in the environment")
    if store_hf_token and via == "ansible":
        raise click.UsageError("--store-hf-token is not available with --via ansible yet")
    run_chain_command(
        ctx,
        "provision",
        vmids,
        dry_run,
        via,
        api_key,
        remove_api_key=no_api_key,
        store_hf_token=store_hf_token,
    )


def operator_api_key() -> str | None:
    """DDOPS_API_KEY from the environment, checked (a bad or empty one is a usage error)."""
    value = os.environ.get(API_KEY_ENV)
    if value is None:
        return None
    try:
        return parse_api_key(value)
    except ValueError as exc:
        raise click.UsageError(f"{exc}; unset it to keep the installed key") from None
