"""The `ddops` command line: one Click group, one module per command in ops/commands/.

    ddops --help
    ddops --host sim:/tmp/pve1 health --ct 200

Global options come before the command. Domain errors (DdopsError) become one line
`Error: <object>: <cause>` on stderr and exit code 1; usage errors and bad input (InputError)
exit 2.
"""

from __future__ import annotations

import logging
import sys

import click

from ops import __version__
from ops.commands.bench import bench_command
from ops.commands.demo import demo_command
from ops.commands.health import health_command
from ops.commands.provision import provision_command
from ops.commands.recover import recover_command
from ops.commands.shared import AppContext
from ops.commands.sim import sim
from ops.errors import DdopsError

COMMANDS = (provision_command, health_command, recover_command, bench_command, demo_command, sim)


class DdopsGroup(click.Group):
    """A Click group that turns DdopsError into `Error: ...` and its exit code (1; 2: bad input)."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except DdopsError as exc:
            click.echo(f"Error: {exc}", err=True)
            if exc.detail:
                click.echo(exc.detail, err=True)
            ctx.exit(exc.exit_code)


@click.group(cls=DdopsGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ddops")
@click.option(
    "-i",
    "--inventory",
    envvar="DDOPS_INVENTORY",
    type=click.Path(dir_okay=False),
    help="The site file (YAML inventory). Env: DDOPS_INVENTORY.",
)
@click.option(
    "--host",
    "host",
    metavar="TARGET",
    help="One host without an inventory: local, sim:PATH, ssh://[user@]host[:port].",
)
@click.option(
    "--json",
    "json_output",
    is_flag=True,
    help="Machine-readable output: one JSON document on stdout.",
)
@click.option("-v", "--verbose", count=True, help="More logging (to stderr).")
@click.option(
    "--accept-new-host-key",
    is_flag=True,
    help="Trust an SSH host key not yet in known_hosts (recorded).",
)
@click.pass_context
def cli(ctx: click.Context, inventory, host, json_output, verbose, accept_new_host_key) -> None:
    """ddops: GPU LLM engines with DDTree speculative decoding on Proxmox VE LXC containers."""
    level = logging.WARNING - 10 * min(verbose, 2)
    logging.basicConfig(
        level=level, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s"
    )
    # paramiko's transport thread logs every failed handshake as an ERROR with a traceback;
    # ddops reports the failure itself, in one line. -vv shows paramiko's words too.
    logging.getLogger("paramiko").setLevel(level if verbose >= 2 else logging.CRITICAL)
    ctx.obj = AppContext(inventory, host, json_output, verbose, accept_new_host_key)


def main() -> None:
    cli(prog_name="ddops")


for _command in COMMANDS:
    cli.add_command(_command)


if __name__ == "__main__":
    main()
