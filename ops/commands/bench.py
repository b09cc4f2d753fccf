"""`ddops bench`: measure ar / DFlash chain / DDTree on a CT's engine and write a report.

    ddops -i site.yml bench --ct 200 [--methods ar,linear,ddtree:15] [--lengths 256,1024,2048] \\
        [--scenario decode,long,agentic] [--repeats N] [--max-repeats M] [--time-budget S] \\
        [--out DIR] [--no-recover]
    ddops bench --url http://127.0.0.1:8000 --lengths 16,32      # an engine by URL, no site
    ddops bench --ct 200 --concurrency 1,4,8 [--requests-per-client N] [--request-rate R] \
        [--seed S] [--slo ttft=2s,tpot=100ms]                     # the serving matrix
    ddops bench report RUN_DIR                                    # re-render a stored run

Before measuring, the CT goes through the health chain and, if a check fails, `recover`
(--no-recover: fail instead). Results go to a new run directory under --out (default
$DDOPS_RESULTS, else <ddops home>/results); rerunning the same command resumes an unfinished
(crashed) run. Progress bars go to stderr; the table (or --json: one document) to stdout.
Methods run interleaved, repeat after repeat (ops/bench/runner.py): at least --repeats clean
repeats per scenario and length, more (up to --max-repeats) while --time-budget seconds last
(0: exactly --repeats); each figure is a median with its interval, each column gets a verdict,
and the machine's state during the run is recorded, with a warning when it was busy.
--concurrency N runs N clients at once (closed loop: each sends its next request when its last
ends; --request-rate R: Poisson arrivals of R a second instead, at most N in flight, repeat r's
drawn from --seed + r), and the report adds aggregate output tok/s, requests/s, goodput under
--slo, TTFT / TPOT / ITL p50, p90 and p99 per cell.
The engine's API key: a CT's own (read from the CT); for --url, DDOPS_API_KEY.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import platform
import time
from pathlib import Path

import click

from engine.machine_state import MachineWatch
from ops.bench.client import EngineClient
from ops.bench.endpoint import Endpoint, site_endpoint, url_endpoint
from ops.bench.figures import rows_from_cells, server_verdicts, verdicts
from ops.bench.matrix import (
    DEFAULT_MAX_REPEATS,
    DEFAULT_METHODS,
    DEFAULT_REPEATS,
    DEFAULT_TIME_BUDGET_S,
    AgenticShape,
    BenchConfig,
    parse_concurrency,
    parse_lengths,
    parse_methods,
    parse_scenarios,
    parse_slo,
)
from ops.bench.report import (
    render_report,
    run_servers,
    servers_lines,
    summary_table,
    verdict_lines,
)
from ops.bench.runner import RichProgress, run_bench
from ops.chain.deploy import API_KEY_ENV
from ops.commands.shared import VIA, VMID
from ops.errors import DdopsError
from ops.results import RunStore


def _parsed(parse):
    """A Click callback turning a parser's DdopsError into a usage error (exit 2)."""

    def callback(ctx: click.Context, param: click.Parameter, value: str):
        try:
            return parse(value)
        except DdopsError as exc:
            raise click.BadParameter(exc.cause) from None

    return callback


@click.group("bench", invoke_without_command=True)
@click.option("--ct", "vmid", type=VMID, help="The CT whose engine.")
@click.option(
    "--url",
    "urls",
    multiple=True,
    help="Bench the engine at this URL instead (no site, no chain); again for servers side by side.",
)
@click.option(
    "--methods",
    default=DEFAULT_METHODS,
    show_default=True,
    callback=_parsed(parse_methods),
    help="ar, linear, ddtree:BUDGET, auto, default, comma-separated.",
)
@click.option(
    "--lengths",
    default="256,1024,2048",
    show_default=True,
    callback=_parsed(parse_lengths),
    help="Output lengths in tokens.",
)
@click.option(
    "--scenario",
    "scenarios",
    default="decode",
    show_default=True,
    callback=_parsed(parse_scenarios),
    help="decode, long (prompt fills max-model-len), agentic (multi-turn ~4k context).",
)
@click.option(
    "--repeats",
    type=click.IntRange(1),
    default=DEFAULT_REPEATS,
    show_default=True,
    help="Clean repeats at least, per scenario and length (every method once a repeat).",
)
@click.option(
    "--max-repeats",
    type=click.IntRange(1),
    default=DEFAULT_MAX_REPEATS,
    show_default=True,
    help="Repeats at most, while the time budget lasts.",
)
@click.option(
    "--time-budget",
    type=click.FloatRange(0),
    default=DEFAULT_TIME_BUDGET_S,
    show_default=True,
    help="Seconds of measuring to spend on more repeats (0: exactly --repeats).",
)
@click.option(
    "--concurrency",
    default="1",
    show_default=True,
    callback=_parsed(parse_concurrency),
    help="Clients at once, comma-separated (each level its own column).",
)
@click.option(
    "--requests-per-client",
    type=click.IntRange(1),
    default=1,
    show_default=True,
    help="Requests each client sends in a method's window (closed loop).",
)
@click.option(
    "--request-rate",
    type=click.FloatRange(0, min_open=True),
    help="Open loop: requests a second, Poisson arrivals (at most --concurrency in flight).",
)
@click.option(
    "--seed",
    type=click.IntRange(0),
    default=0,
    show_default=True,
    help="Repeat r's Poisson arrivals are random.Random(seed + r)'s gaps (guidellm's poisson "
    "profile with --seed kind=static,value=S draws the same); also each request's sampling seed.",
)
@click.option(
    "--slo",
    callback=_parsed(lambda text: parse_slo(text) if text else None),
    help="Goodput's objective, e.g. ttft=2s,tpot=100ms.",
)
@click.option("--warmup", type=click.IntRange(0), default=1, show_default=True)
@click.option("--agentic-context", type=click.IntRange(16), default=4096, show_default=True)
@click.option("--agentic-turns", type=click.IntRange(1), default=4, show_default=True)
@click.option("--out", type=click.Path(file_okay=False), help="Results directory.")
@click.option("--no-recover", is_flag=True, help="Fail when a health check fails; repair nothing.")
@VIA
@click.pass_context
def bench_command(ctx: click.Context, vmid, urls, out, no_recover, via, **matrix) -> None:
    """Measure decoding methods x output lengths x scenarios; write results and a report."""
    if ctx.invoked_subcommand:
        return
    if matrix["max_repeats"] < matrix["repeats"]:
        raise click.BadParameter("must be >= --repeats", param_hint="--max-repeats")
    config = bench_config(matrix, servers=max(1, len(urls)))
    if via == "ansible":
        if urls:
            raise click.UsageError("--via ansible benches the site's CTs (--ct), not a --url")
        from ops.commands.via_ansible import bench_via_ansible

        return bench_via_ansible(ctx, vmid, config, out, no_recover)
    if (vmid is None) == (not urls):
        raise click.UsageError("name the engine: --ct VMID (with a site) or --url URL")
    if len(set(urls)) < len(urls):
        raise click.BadParameter("each server once", param_hint="--url")
    results = Path(out) if out else _default_results()
    with contextlib.ExitStack() as stack:
        if urls:
            key = os.environ.get(API_KEY_ENV) or None
            reached = [stack.enter_context(url_endpoint(url, key)) for url in urls]
        else:
            site = site_endpoint(ctx.obj, vmid=vmid, results=results, recover_first=not no_recover)
            reached = [stack.enter_context(site)]
        clients = [stack.enter_context(EngineClient(e.url, e.api_key)) for e in reached]
        store = RunStore.open(results, _run_config(reached, config), _versions(reached, clients))
        result = run_bench(config, clients, store, RichProgress(), _watch(reached, clients))
    files = render_report(result.run_dir)
    _print_outcome(ctx.obj.json, reached, result.run_dir, result.resumed, files)


def bench_config(matrix: dict, servers: int = 1) -> BenchConfig:
    """The BenchConfig of `ddops bench`'s matrix options (Click's parameter values)."""
    return BenchConfig(
        methods=matrix["methods"],
        lengths=matrix["lengths"],
        scenarios=matrix["scenarios"],
        repeats=matrix["repeats"],
        warmup=matrix["warmup"],
        agentic=AgenticShape(matrix["agentic_context"], matrix["agentic_turns"]),
        max_repeats=matrix["max_repeats"],
        time_budget_s=matrix["time_budget"],
        concurrency=matrix["concurrency"],
        requests_per_client=matrix["requests_per_client"],
        request_rate=matrix["request_rate"],
        seed=matrix["seed"],
        slo=matrix["slo"],
        servers=servers,
    )


@bench_command.command("report")
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
@click.pass_context
def report_command(ctx: click.Context, run_dir: str) -> None:
    """Re-render the report (markdown, CSV, JSON, plots) of a stored run."""
    files = render_report(Path(run_dir))
    store = RunStore.load(Path(run_dir))
    rows, machine = rows_from_cells(store.cells()), store.manifest.get("machine")
    if ctx.obj.json:
        document = {"run_dir": run_dir, "files": _paths(files), "rows": rows}
        document |= {"verdicts": verdicts(rows), "machine": machine}
        document |= {"servers": run_servers(store), "server_verdicts": server_verdicts(rows)}
        click.echo(json.dumps(document, indent=1))
    else:
        click.echo(files.markdown.read_text())  # what render_report just wrote


def _watch(endpoints: list[Endpoint], clients: list[EngineClient]) -> MachineWatch:
    """Readings of the (first) engine's machine; "own" CPU is the engines' (their /metrics)
    and, when the bench runs on the same machine, the bench's."""

    def own_cpu_s() -> float | None:
        engines = [client.engine_cpu_seconds() for client in clients]
        if None in engines:
            return None
        here = any(endpoint.here for endpoint in endpoints)
        return sum(engines) + (time.process_time() if here else 0.0)

    first = endpoints[0]
    return MachineWatch(first.read_text, first.run, own_cpu_s)


def _default_results() -> Path:
    from ops.site.selection import results_dir

    return results_dir()


def _target(endpoints: list[Endpoint]) -> str:
    return " + ".join(endpoint.target for endpoint in endpoints)


def _run_config(endpoints: list[Endpoint], config: BenchConfig) -> dict:
    """What a run measures; a rerun with an equal dict resumes it."""
    return {"target": _target(endpoints), "bench": config.to_json()}


def _versions(endpoints: list[Endpoint], clients: list[EngineClient]) -> dict:
    cards = [client.model_card() for client in clients]
    versions = {
        "ddops": importlib.metadata.version("ddops"),
        "python": platform.python_version(),
        "model": cards[0].get("id"),
        "max_model_len": cards[0].get("max_model_len"),
    }
    if len(clients) > 1:
        versions["servers"] = [
            {"url": e.url, "model": card.get("id"), "max_model_len": card.get("max_model_len")}
            for e, card in zip(endpoints, cards, strict=True)
        ]
    return versions


def _paths(files) -> dict:
    return {
        "markdown": str(files.markdown),
        "csv": str(files.csv),
        "json": str(files.json),
        "plots": [str(p) for p in files.plots],
    }


def _print_outcome(
    as_json: bool, endpoints: list[Endpoint], run_dir: Path, resumed: bool, files
) -> None:
    store = RunStore.load(run_dir)
    rows, manifest = rows_from_cells(store.cells()), store.manifest
    machine = manifest.get("machine") or {}
    if as_json:
        document = {
            "target": _target(endpoints),
            "run_dir": str(run_dir),
            "state": manifest["state"],
            "resumed": resumed,
            "preflight": endpoints[0].preflight,
            "files": _paths(files),
            "rows": rows,
            "verdicts": verdicts(rows),
            "server_verdicts": server_verdicts(rows),
            "machine": machine,
        }
        click.echo(json.dumps(document, indent=1))
        return
    click.echo(f"bench of {_target(endpoints)}" + (" (resumed a crashed run)" if resumed else ""))
    click.echo("\n".join(summary_table(rows)))
    click.echo("\n".join(["", *verdict_lines(rows)]))
    if side_by_side := servers_lines(rows, run_servers(store)):
        click.echo("\n".join(["", *side_by_side]))
    if machine.get("warning"):
        click.echo(f"\nwarning: {machine['warning']}")
    click.echo(f"\nreport: {files.markdown} (CSV, JSON and plots beside it)")
