"""Run ddops' playbooks (playbooks/*.yml) through ansible-runner, for a fleet or one host.

    with open_site(inventory="site.yml", host=None, vmids=[]) as opened:
        run = run_chain_playbook(opened, "provision", {"unlock": False}, dry_run=False,
                                 inventory="site.yml", on_progress=print)
    run.reports            # ChainReport per CT, from the playbook's ddops_check results
    run.hosts              # HostOutcome per host: ok / changed / failed / unreachable, and why
    render_hosts(run.hosts); hosts_json(run.hosts)

The playbooks read the same YAML inventory as the CLI. ddops hands ansible-runner a copy in
which every local or simulated host (ddops_target `local` / `sim:PATH`) gets
`ansible_connection: local` and this Python as its interpreter (it has ddops); with `--host` and
no inventory, it writes a one-host inventory from the site. A failure on one host is reported
with that host; the others go on (Ansible's own behaviour, kept: no any_errors_fatal).
`ansible-playbook` must be on PATH: this Python's bin directory is put first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from rich.console import Console
from rich.table import Table

from ops.bench.matrix import BenchConfig, Slo
from ops.chain.checks import chain_for
from ops.chain.report import ChainReport, CheckResult
from ops.errors import DdopsError
from ops.host.targets import parse_target
from ops.host.wheel import built_wheel
from ops.resources import playbooks_dir
from ops.site.inventory import Site, site_document
from ops.site.selection import OpenedSite

PLAYBOOKS = {"provision": "provision.yml", "recover": "recover.yml", "bench": "bench.yml"}
CHECK_MODULE = "ddops_check"
HOST_EVENTS = {
    "runner_on_ok": "ok",
    "runner_on_failed": "failed",
    "runner_on_unreachable": "unreachable",
    "runner_on_skipped": "skipped",
}

Progress = Callable[[str], None]


@dataclass
class HostOutcome:
    """One host's play: ok, changed, failed or unreachable, and the first failure in words."""

    host: str
    status: str = "ok"
    detail: str = ""
    changed_tasks: int = 0
    skipped_tasks: int = 0  # e.g. in check mode, the checks a planned change leaves moot

    @property
    def ok(self) -> bool:
        return self.status in ("ok", "changed")


@dataclass
class PlaybookRun:
    """What a playbook did: per host, and per CT for the chain's checks."""

    hosts: dict[str, HostOutcome] = field(default_factory=dict)
    reports: dict[tuple[str, int], ChainReport] = field(default_factory=dict)
    task_results: list[dict] = field(default_factory=list)  # {host, task, res} of ok/failed tasks

    @property
    def ok(self) -> bool:
        return all(h.ok for h in self.hosts.values())


# -- the inventory ansible-runner gets -----------------------------------------------------------


def connection_vars(target: str) -> dict:
    """How Ansible reaches a host named by a ddops target."""
    parsed = parse_target(target)
    if parsed.kind != "ssh":
        return {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}
    return {"ansible_host": parsed.host, "ansible_port": parsed.port, "ansible_user": parsed.user}


def site_inventory(site: Site) -> dict:
    """An inventory document for a site that came from `--host` (no inventory file)."""
    document = site_document(site)
    for host in site.hosts:
        document["all"]["hosts"][host.name] = {
            **connection_vars(host.target),
            **document["all"]["hosts"][host.name],
        }
    return document


def with_local_connections(document: dict) -> dict:
    """The user's inventory, local and simulated hosts reached with a local connection."""
    document = json.loads(json.dumps(document))
    for hostvars in (document["all"].get("hosts") or {}).values():
        target = (hostvars or {}).get("ddops_target")
        if target and parse_target(target).kind != "ssh":
            for name, value in connection_vars(target).items():
                hostvars.setdefault(name, value)
    return document


# -- running a playbook --------------------------------------------------------------------------


def run_playbook(
    name: str,
    inventory: dict,
    *,
    check: bool = False,
    limit: Sequence[str] = (),
    tags: Sequence[str] = (),
    extravars: dict | None = None,
    mode: str = "",
    on_progress: Progress | None = None,
) -> PlaybookRun:
    """Run playbooks/<name>.yml over an inventory document; per-host and per-CT results."""
    import ansible_runner  # heavy, and only this path needs it

    run = PlaybookRun()
    options = ["--check", "--diff"] if check else []
    if tags:
        options += ["--tags", ",".join(tags)]
    with tempfile.TemporaryDirectory(prefix="ddops-ansible-") as workdir:
        inventory_path = Path(workdir) / "inventory.yml"
        inventory_path.write_text(yaml.safe_dump(inventory, sort_keys=False))
        runner = ansible_runner.run(
            private_data_dir=workdir,
            playbook=str(playbooks_dir() / PLAYBOOKS[name]),
            inventory=str(inventory_path),
            limit=",".join(limit) or None,
            extravars=extravars or {},
            cmdline=" ".join(options) or None,
            envvars=_env(),
            event_handler=lambda event: _on_event(run, event, mode, check, on_progress),
            quiet=True,
        )
        if not run.hosts and runner.rc != 0:
            raise DdopsError(f"playbook {name}", _runner_failure(runner))
    return run


def search_path() -> str:
    """PATH with this Python's bin directory first: its ansible-playbook, else the one PATH has
    (a venv made with --system-site-packages over an interpreter that holds ansible)."""
    return os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])


def _env() -> dict[str, str]:
    """ansible-playbook from this Python's environment; modules piped to the host's Python
    (pipelining: one SSH round trip per task instead of three)."""
    return {
        "PATH": search_path(),
        "ANSIBLE_PIPELINING": "1",
        "ANSIBLE_NOCOWS": "1",
        "ANSIBLE_RETRY_FILES_ENABLED": "0",
    }


def _runner_failure(runner) -> str:
    """The last lines ansible-playbook wrote, when it failed before any host ran."""
    lines = [line for line in runner.stdout.read().splitlines() if line.strip()]
    return f"ansible-playbook exited {runner.rc}: " + (" | ".join(lines[-3:]) or "no output")


def _on_event(
    run: PlaybookRun, event: dict, mode: str, check: bool, on_progress: Progress | None
) -> bool:
    data = event.get("event_data") or {}
    status = HOST_EVENTS.get(event.get("event", ""))
    if status is None or "host" not in data:
        return False
    host, res = data["host"], data.get("res") or {}
    outcome = run.hosts.setdefault(host, HostOutcome(host))
    if status == "ok" and res.get("changed"):
        outcome.changed_tasks += 1
        outcome.status = "changed" if outcome.ok else outcome.status
    elif status == "skipped":
        outcome.skipped_tasks += 1
    elif status in ("failed", "unreachable") and not data.get("ignore_errors"):
        outcome.status = status
        outcome.detail = outcome.detail or f"{data.get('task', '')}: {res.get('msg', '')}".strip()
    if data.get("task_action") == CHECK_MODULE and status == "skipped":
        _record_skipped_check(run, host, data.get("task", ""), mode, on_progress)
    elif data.get("task_action") == CHECK_MODULE:
        for item in res.get("results") or []:
            _record_check(run, host, item, mode, check, on_progress)
    elif on_progress:
        on_progress(f"{host}: {data.get('task', '')}: {_task_status(status, res)}")
    if res and status in ("ok", "failed"):
        run.task_results.append({"host": host, "task": data.get("task", ""), "res": res})
    return False


def _task_status(status: str, res: dict) -> str:
    if status == "ok" and res.get("changed"):
        return "changed"
    return status


def _record_skipped_check(
    run: PlaybookRun, host: str, task: str, mode: str, on_progress: Progress | None
) -> None:
    """A check task Ansible reports as skipped: its event carries no results (Ansible drops a
    skipped task's result), so each of the host's CTs gets the check as skipped, with the needs
    that did not pass. A task its `when` skipped (not in this mode's chain) is no check here."""
    chain = {c.title.lower(): c for c in chain_for(mode)}
    found = chain.get(task.lower())
    if found is None:
        return
    for (name, vmid), report in run.reports.items():
        if name != host or any(r.key == found.key for r in report.results):
            continue
        done = {r.key: r.status for r in report.results}
        unmet = [n for n in found.needs if done.get(n, "ok") not in ("ok", "unchanged", "changed")]
        why = f"needs {', '.join(unmet)}" if unmet else "an earlier check failed"
        report.results.append(CheckResult(found.key, found.title, "skipped", 0.0, why))
        if on_progress:
            on_progress(f"{host}: CT {vmid}: {'skipped':>12}  {found.title} (0.0s)")


def _record_check(
    run: PlaybookRun, host: str, item: dict, mode: str, check: bool, on_progress: Progress | None
) -> None:
    vmid = int(item["vmid"])
    result = CheckResult(**{name: value for name, value in item.items() if name != "vmid"})
    report = run.reports.setdefault((host, vmid), ChainReport(host, vmid, mode, check))
    report.results.append(result)
    report.seconds += result.seconds
    if on_progress:
        on_progress(
            f"{host}: CT {vmid}: {result.status:>12}  {result.title} ({result.seconds:.1f}s)"
        )


# -- the chain commands (provision, recover) through their playbooks ----------------------------


def chain_inventory(opened: OpenedSite, inventory: str | None) -> dict:
    """The inventory document for the playbooks: the user's file, or one made from `--host`."""
    if inventory is None:
        return site_inventory(opened.site)
    return with_local_connections(yaml.safe_load(Path(inventory).read_text()))


def run_chain_playbook(
    opened: OpenedSite,
    mode: str,
    options: dict,
    *,
    dry_run: bool,
    inventory: str | None,
    on_progress: Progress | None = None,
) -> PlaybookRun:
    """`ddops provision|recover --via ansible`: the selected CTs through playbooks/<mode>.yml,
    the run's `options` (unlock, remove_api_key) handed to its tasks, which set the policy with
    ops.chain.runner.chain_run. Provision first installs this ddops on each host, from a wheel
    built here."""
    vmids = sorted({target.ct.vmid for target in opened.targets})
    hosts = sorted({target.host.name for target in opened.targets})
    extravars = {
        "ddops_vmids": vmids,
        "ddops_unlock": options.get("unlock", False),
        "ddops_remove_api_key": options.get("remove_api_key", False),
    }
    with built_wheel() if mode == "provision" else contextlib.nullcontext() as wheel:
        if wheel is not None:
            extravars["ddops_wheel"] = str(wheel)
        return run_playbook(
            mode,
            chain_inventory(opened, inventory),
            check=dry_run,
            limit=hosts,
            extravars=extravars,
            mode=mode,
            on_progress=on_progress,
        )


# -- bench through its playbook -----------------------------------------------------------------


def slo_text(slo: Slo) -> str:
    """`--slo`'s spelling of `slo` (what parse_slo reads back)."""
    parts = [(name, value) for name, value in (("ttft", slo.ttft_s), ("tpot", slo.tpot_s))]
    return ",".join(f"{name}={1000 * value:g}ms" for name, value in parts if value is not None)


def bench_args(config: BenchConfig) -> list[str]:
    """`ddops bench` options that give this config (what each host's ddops bench is told)."""
    return [
        *("--methods", ",".join(m.label for m in config.methods)),
        *("--lengths", ",".join(map(str, config.lengths))),
        *("--scenario", ",".join(config.scenarios)),
        *("--repeats", str(config.repeats), "--warmup", str(config.warmup)),
        *("--max-repeats", str(config.max_repeats), "--time-budget", str(config.time_budget_s)),
        *("--agentic-context", str(config.agentic.context)),
        *("--agentic-turns", str(config.agentic.turns)),
        *("--concurrency", ",".join(map(str, config.concurrency))),
        *("--requests-per-client", str(config.requests_per_client)),
        *(("--request-rate", str(config.request_rate)) if config.request_rate else ()),
        *("--seed", str(config.seed)),
        *(("--slo", slo_text(config.slo)) if config.slo else ()),
    ]


def run_bench_playbook(
    opened: OpenedSite,
    config: BenchConfig,
    *,
    inventory: str | None,
    fetch_dir: Path,
    out: str | None = None,
    no_recover: bool = False,
    on_progress: Progress | None = None,
) -> PlaybookRun:
    """`ddops bench --via ansible`: each host benches its selected CTs; reports land in
    fetch_dir/<host>/<run>/."""
    extravars = {
        "ddops_vmids": sorted({target.ct.vmid for target in opened.targets}),
        "ddops_bench_args": bench_args(config),
        "ddops_bench_no_recover": no_recover,
        "ddops_bench_fetch_dir": str(fetch_dir),
    }
    if out:
        extravars["ddops_bench_out"] = out
    return run_playbook(
        "bench",
        chain_inventory(opened, inventory),
        limit=sorted({target.host.name for target in opened.targets}),
        extravars=extravars,
        mode="bench",
        on_progress=on_progress,
    )


def bench_documents(run: PlaybookRun) -> list[dict]:
    """Each CT's bench document, with its host: {"host", "vmid", "rc", "document" | "error"}."""
    return [
        {"host": result["host"], **bench}
        for result in run.task_results
        for bench in result["res"].get("benches") or []
    ]


# -- output --------------------------------------------------------------------------------------

_HOST_STYLE = {"ok": "green", "changed": "yellow", "failed": "bold red", "unreachable": "bold red"}


def render_hosts(hosts: dict[str, HostOutcome], console: Console | None = None) -> None:
    """The per-host result table."""
    table = Table(title="hosts", title_justify="left")
    for column in ("host", "result", "changed tasks", "why"):
        table.add_column(column, overflow="fold")
    for h in hosts.values():
        style = _HOST_STYLE[h.status]
        table.add_row(h.host, f"[{style}]{h.status}[/]", str(h.changed_tasks), h.detail)
    (console or Console()).print(table)


def hosts_json(hosts: dict[str, HostOutcome]) -> list[dict]:
    return [dataclasses.asdict(h) | {"ok": h.ok} for h in hosts.values()]
