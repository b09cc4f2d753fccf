"""`--via ansible` for `ddops provision` and `ddops recover`: the same chain, run by the playbooks.

    ddops -i site.yml provision --via ansible            # every host of the site, in parallel
    ddops -i site.yml recover --ct 200 --via ansible --dry-run   # ansible-playbook --check --diff
    ddops --host sim:/tmp/pve1 provision --ct 200 --via ansible  # a one-host inventory is written

Progress streams to stderr as the playbook runs (one line per task, per CT for the checks);
stdout gets the per-CT chain tables and the per-host result table (or --json: one document,
the direct path's plus "hosts"). Exit 1 when a host failed or was unreachable.
"""

from __future__ import annotations

import json

import click

from ops.ansible import hosts_json, render_hosts, run_chain_playbook
from ops.checks import Policy
from ops.recover import render_reports, reports_json
from ops.site import OpenedSite


def chain_via_ansible(
    ctx: click.Context, opened: OpenedSite, mode: str, policy: Policy, dry_run: bool
) -> None:
    app = ctx.obj
    run = run_chain_playbook(
        opened,
        mode,
        policy,
        dry_run=dry_run,
        inventory=app.inventory,
        on_progress=None if app.json else lambda line: click.echo(line, err=True),
    )
    reports = list(run.reports.values())
    if app.json:
        click.echo(json.dumps({**reports_json(reports), "hosts": hosts_json(run.hosts)}, indent=2))
    else:
        render_reports(reports)
        render_hosts(run.hosts)
    planned_only = dry_run and not any(r.status == "failed" for x in reports for r in x.results)
    if not run.ok or not (all(r.ok for r in reports) or planned_only):
        ctx.exit(1)
