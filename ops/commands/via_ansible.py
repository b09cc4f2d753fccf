"""`--via ansible` for `ddops provision`, `recover` and `bench`: the same work, run by the playbooks.

    ddops -i site.yml provision --via ansible            # every host of the site, in parallel
    ddops -i site.yml recover --ct 200 --via ansible --dry-run   # ansible-playbook --check --diff
    ddops --host sim:/tmp/pve1 provision --ct 200 --via ansible  # a one-host inventory is written
    ddops -i site.yml bench --via ansible --lengths 256  # every CT, each host benching its own

Progress streams to stderr as the playbook runs (one line per task, per CT for the checks);
stdout gets the per-CT tables and the per-host result table (or --json: one document, for the
chain the direct path's plus "hosts"). Exit 1 when a host failed or was unreachable.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from ops.ansible import (
    bench_documents,
    hosts_json,
    render_hosts,
    run_bench_playbook,
    run_chain_playbook,
)
from ops.bench.matrix import BenchConfig
from ops.bench.report import summary_table
from ops.chain.output import render_reports
from ops.chain.report import reports_json
from ops.site.selection import OpenedSite, results_dir


def _progress(ctx: click.Context):
    return None if ctx.obj.json else lambda line: click.echo(line, err=True)


def chain_via_ansible(
    ctx: click.Context, opened: OpenedSite, mode: str, dry_run: bool, options: dict
) -> None:
    """provision / recover over the opened site's CTs through playbooks/<mode>.yml, with the
    run's `options` (ops.chain.checks.Policy's fields) for the playbook's ddops_check tasks."""
    app = ctx.obj
    run = run_chain_playbook(
        opened,
        mode,
        options,
        dry_run=dry_run,
        inventory=app.inventory,
        on_progress=_progress(ctx),
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


def bench_via_ansible(
    ctx: click.Context, vmid: int | None, config: BenchConfig, out: str | None, no_recover: bool
) -> None:
    """bench over the site's CTs (or one) through playbooks/bench.yml; reports fetched here."""
    app = ctx.obj
    fetch_dir = (Path(out) if out else results_dir()) / "fleet"
    with app.open_site([vmid] if vmid else []) as opened:
        run = run_bench_playbook(
            opened,
            config,
            inventory=app.inventory,
            fetch_dir=fetch_dir,
            out=out,
            no_recover=no_recover,
            on_progress=_progress(ctx),
        )
    benches = bench_documents(run)
    if app.json:
        document = {
            "fetched_to": str(fetch_dir),
            "benches": benches,
            "hosts": hosts_json(run.hosts),
        }
        click.echo(json.dumps(document, indent=1))
    else:
        for bench in benches:
            click.echo(f"\nCT {bench['vmid']} on {bench['host']}:")
            rows = (bench.get("document") or {}).get("rows")
            click.echo("\n".join(summary_table(rows)) if rows else bench.get("error", "no rows"))
        render_hosts(run.hosts)
        click.echo(f"report files: {fetch_dir}/<host>/<run>/")
    if not run.ok:
        ctx.exit(1)
