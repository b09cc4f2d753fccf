"""`ddops demo`: the whole lifecycle on a simulated Proxmox host, on this machine's CPU.

    sim init -> provision (the demo model pair, served by the sim host's own hub) -> health
    -> sim reboot (the incident: the uvm major moves, /dev/shm empties; the boot units repair it)
    -> health (shows what the boot-time recovery did) -> recover (nothing left) -> bench
    -> bench agentic (an agent's turns with the engine's prefix cache on and off)
    -> bench serving (ar, ddtree:15 and the server's default with 1 and 4 clients at once)

Every stage runs the real `ddops --json` command in-process against a site file the demo writes
(WORKDIR/site.yml), so what the demo shows is exactly what a user runs; the demo reads each
stage's document and tells the story in one screen (`story_lines`). The sim host (its hub
too: ops/sim/hubservice.py, at an address that is the host's for good, so the site file stays
true after the demo), the results and the report all live under WORKDIR.

The bench runs its methods interleaved, repeat after repeat within a time budget (BENCH_REPEATS
at least, more while BENCH_BUDGET_S lasts): the story shows each speedup with its interval and
names a winner only when its interval clears the others'; a busy machine gets a warning.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import textwrap
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from engine.bench_stats import interval_name
from ops.bench.figures import spread_of
from ops.chain.checks import CHAIN
from ops.errors import DdopsError
from ops.sim.hubservice import DEMO_MODEL_DIR, DEMO_REPOS, bytes_served, ensure_hub, free_port

DEMO_VMID = 200
INCIDENT_UVM_MAJORS = (511, 509)  # before and after the reboot, as in the incident report
BENCH_METHODS = "ar,linear,ddtree:4,ddtree:8,ddtree:15,ddtree:32"  # budgets make a curve
BENCH_LENGTHS = "128"
BENCH_REPEATS = "3"
BENCH_BUDGET_S = "120"
# The agentic stage: the served method against ar, short answers, a conversation growing to
# ~1.5k tokens over 4 turns (max_model_len is 2048): time to first token with the cache on/off.
AGENTIC_ARGS = ("--methods", "ar,ddtree:15", "--scenario", "agentic", "--lengths", "32",
                "--agentic-context", "1536", "--agentic-turns", "4", "--repeats", "3",
                "--time-budget", "0")  # fmt: skip
AGENTIC_METHOD = "ddtree:15"
# The serving stage: 1 and 4 clients at once, short answers: aggregate tok/s and p50 TTFT.
SERVING_METHODS = ("ar", "ddtree:15", "default")
SERVING_LEVELS = (1, 4)
SERVING_ARGS = ("--methods", ",".join(SERVING_METHODS), "--lengths", "32",
                "--concurrency", ",".join(map(str, SERVING_LEVELS)), "--repeats", "3",
                "--time-budget", "0")  # fmt: skip
WIDTH = 100


@dataclass
class Stage:
    name: str
    argv: list[str]
    exit_code: int = 0
    seconds: float = 0.0
    document: dict | None = None  # what the command printed with --json
    hub_bytes: int = 0  # bytes the sim host's hub served during the stage


@dataclass
class DemoResult:
    workdir: Path
    hub_url: str = ""
    stages: list[Stage] = field(default_factory=list)
    report: Path | None = None  # the bench's
    agentic_report: Path | None = None

    def stage(self, name: str) -> Stage | None:
        return next((s for s in self.stages if s.name == name), None)


def site_document(sim_root: Path, hub_url: str, port: int) -> dict:
    """The demo's inventory: one sim host, CT 200, the demo pair, the engine on this Python."""
    return {
        "all": {
            "vars": {
                "ddops_model": {
                    "target": {"repo": DEMO_REPOS["target"], "name": "target"},
                    "draft": {"repo": DEMO_REPOS["draft"], "name": "draft"},
                    "hub_endpoint": hub_url,
                },
                "ddops_engine": {
                    "method": "ddtree",
                    "budget": 15,
                    "port": port,
                    "max_model_len": 2048,
                    "dtype": "float32",
                    "device": "cpu",
                    "python": sys.executable,
                },
            },
            "hosts": {
                "pve-sim": {
                    "ddops_target": f"sim:{sim_root}",
                    "ddops_containers": [
                        {"vmid": DEMO_VMID, "hostname": "llm", "cores": 2, "memory_mib": 8192,
                         "shm_gib": 1, "device_style": "raw"}
                    ],
                }
            },
        }
    }  # fmt: skip


def stages(workdir: Path, site: Path) -> list[Stage]:
    sim, ct = str(workdir / "host"), str(DEMO_VMID)
    inv = ["-i", str(site)]
    return [
        Stage("sim init", ["sim", "init", sim, "--uvm-major", str(INCIDENT_UVM_MAJORS[0])]),
        Stage("provision", [*inv, "provision", "--ct", ct]),
        Stage("health", [*inv, "health", "--ct", ct]),
        Stage("sim reboot", ["sim", "reboot", sim, "--uvm-major", str(INCIDENT_UVM_MAJORS[1])]),
        Stage("health after reboot", [*inv, "health", "--ct", ct]),
        Stage("recover", [*inv, "recover", "--ct", ct]),
        Stage("bench", [*inv, "bench", "--ct", ct, "--methods", BENCH_METHODS,
                        "--lengths", BENCH_LENGTHS, "--repeats", BENCH_REPEATS,
                        "--time-budget", BENCH_BUDGET_S]),
        Stage("bench agentic", [*inv, "bench", "--ct", ct, *AGENTIC_ARGS]),
        Stage("bench serving", [*inv, "bench", "--ct", ct, *SERVING_ARGS]),
    ]  # fmt: skip


@contextlib.contextmanager
def _environment(**values: str) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_stage(
    stage: Stage, invoke: Callable[[Sequence[str]], int], served: Callable[[], int]
) -> None:
    """Run `ddops --json ARGV` in this process; its document kept, its chatter dropped unless
    it fails (DdopsError with the stage's own last words). `served`: the hub's bytes so far."""
    out, err = io.StringIO(), io.StringIO()
    before, start = served(), time.monotonic()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        stage.exit_code = invoke(["--json", *stage.argv])
    stage.seconds = time.monotonic() - start
    stage.hub_bytes = served() - before
    with contextlib.suppress(ValueError):
        stage.document = json.loads(out.getvalue())
    if stage.exit_code != 0:
        said = (err.getvalue().strip() or out.getvalue().strip()).splitlines()
        raise DdopsError(
            "demo", f"stage '{stage.name}' failed (exit {stage.exit_code})", "\n".join(said[-20:])
        )


def run_demo(
    workdir: Path,
    invoke: Callable[[Sequence[str]], int],
    on_stage: Callable[[Stage, bool], None] = lambda stage, done: None,
) -> DemoResult:
    """Run every stage; `on_stage(stage, done)` before and after each (for a progress display)."""
    from ops.sim.host import destroy_host
    from ops.sim.state import is_sim_root

    if not (DEMO_MODEL_DIR / "target" / "config.json").is_file():
        raise DdopsError(str(DEMO_MODEL_DIR), "the demo model pair is missing from this install")
    workdir = workdir.resolve()
    sim_root = workdir / "host"
    if is_sim_root(sim_root):
        destroy_host(sim_root)  # a fresh host each run: the demo tells the whole story
    workdir.mkdir(parents=True, exist_ok=True)
    result = DemoResult(workdir)
    results = workdir / "results"  # the chain's stale-run check and the bench share it
    site = workdir / "site.yml"
    with _environment(DDOPS_RESULTS=str(results)):
        for stage in stages(workdir, site):
            result.stages.append(stage)
            on_stage(stage, False)
            run_stage(stage, invoke, lambda: bytes_served(sim_root) if result.hub_url else 0)
            on_stage(stage, True)
            if not result.hub_url:  # the host is made: its hub serves the site's models
                result.hub_url = ensure_hub(sim_root)
                document = site_document(sim_root, result.hub_url, free_port())
                site.write_text(yaml.safe_dump(document, sort_keys=False))
    result.report = _report_of(result.stage("bench"))
    result.agentic_report = _report_of(result.stage("bench agentic"))
    return result


def _report_of(stage: Stage | None) -> Path | None:
    markdown = ((stage and stage.document) or {}).get("files", {}).get("markdown")
    return Path(markdown) if markdown else None


# -- the story, in one screen -----------------------------------------------------------------
def _fit(text: str, width: int = WIDTH) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def _checks(stage: Stage) -> list[dict]:
    return [check for ct in (stage.document or {}).get("cts", []) for check in ct["checks"]]


def stage_line(stage: Stage) -> str:
    """One line per stage: what it found or did, and how long it took."""
    doc, what = stage.document or {}, ""
    if stage.name == "sim init":
        what = (
            f"PVE {doc.get('pve_version')}, {doc.get('gpus')} fake GPU, nvidia-uvm major "
            f"{doc.get('uvm_major')}, {doc.get('containers')} containers"
        )
    elif stage.name == "sim reboot":
        what = (
            f"CTs stopped, /dev/shm emptied, uvm {doc.get('uvm_major_before')} -> "
            f"{doc.get('uvm_major')}, {len(doc.get('units', []))} boot units ran"
        )
    elif stage.name == "bench":
        repeats = max((r.get("repeats") or 0 for r in doc.get("rows", [])), default=0)
        what = (
            f"{len(doc.get('rows', []))} methods x {BENCH_LENGTHS} new tokens, "
            f"{repeats} interleaved repeats"
        )
    elif stage.name == "bench serving":
        levels = " and ".join(map(str, SERVING_LEVELS))
        what = f"{len(SERVING_METHODS)} methods x {levels} clients at once, 32 new tokens"
    elif stage.name == "bench agentic":
        turns = _agentic_turns(doc)
        cached = "/".join(
            "-" if t["cached_tokens"] is None else f"{t['cached_tokens']:.0f}" for t in turns
        )
        what = f"{len(turns)} turns, prefix cache on and off; tokens cached by turn {cached}"
    elif checks := _checks(stage):
        counts: dict[str, int] = {}
        for check in checks:
            counts[check["status"]] = counts.get(check["status"], 0) + 1
        verdict = "healthy" if doc.get("ok") else "NOT healthy"
        tally = ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))
        what = f"CT {DEMO_VMID} {verdict}: {tally} checks"
    return f"  {stage.name:<20} {_fit(what, WIDTH - 33):<67} {stage.seconds:6.1f}s"


def boot_story(result: DemoResult) -> list[str]:
    """What the boot-time recovery repaired, with nobody acting, and how long the host took."""
    reboot, health = result.stage("sim reboot"), result.stage("health after reboot")
    if not (reboot and health and health.document):
        return []
    (ct,) = health.document["cts"]
    last = ct.get("last_recover")
    if not last or last["trigger"] != "boot":
        return ["", "No boot-time recovery ran: `ddops recover` repaired the CT by hand."]
    lines = ["", "The reboot, repaired at boot by ddops-recover.service with nobody acting:"]
    for repair in last["repaired"]:
        lines += [
            f"  {repair['title']}",
            _fit(f"    found: {repair['found']}"),
            _fit(f"    did:   {repair['done']}"),
        ]
    after = _seconds_after_engine(last)
    recover = (
        f"the recover {last['seconds'] - after:.1f} s"
        if after
        else f"the recover {last['seconds']:g} s"
    )
    lines.append(
        f"  reboot -> healthy engine in {reboot.seconds - after:.1f} s ({recover}), "
        f"{reboot.hub_bytes} bytes downloaded from the hub"
    )
    if after:  # its own line: the story keeps within 100 columns
        lines.append(f"  then {after:.1f} s of the checks after the engine's, while it served")
    return lines


def _seconds_after_engine(last: dict) -> float:
    """What the boot's recovery spent on the checks after `engine` (the next boot's kernel, the
    host's ddops, ...): the engine was serving by then. 0 when the record has no timings."""
    keys = [check.key for check in CHAIN]
    later = keys[keys.index("engine") + 1 :]
    return round(sum(last.get("timings", {}).get(key, 0.0) for key in later), 1)


def bench_story(result: DemoResult) -> list[str]:
    """The bench table (tau, decode tok/s, speedup over ar with its interval), the verdict, a
    warning when the machine was busy, and the prefix cache's line."""
    bench = result.stage("bench")
    doc = (bench.document or {}) if bench else {}
    measured = [r for r in doc.get("rows", []) if r.get("decode_tok_s")]
    if not measured:
        return []
    repeats = max(r.get("repeats") or 0 for r in measured)
    interval = interval_name(min(r.get("repeats") or 1 for r in measured))
    lines = ["", f"Bench on the demo pair ({BENCH_LENGTHS} new tokens, CPU, {repeats} interleaved "
             "repeats):", ""]  # fmt: skip
    lines.append(f"  {'method':<11} {'tau':>5} {'tok/s':>8}   vs ar (median and {interval})")
    for r in measured:
        spread = spread_of(r, "speedup")
        tau = f"{r['tau']:.2f}" if r.get("tau") else "-"
        lines.append(
            f"  {r['method']:<11} {tau:>5} {r['decode_tok_s']:>8.1f}   {spread.text('x') if spread else '-'}"
        )
    for found in doc.get("verdicts", []):
        lines += ["", *textwrap.wrap(f"Verdict: {found['text']}.", WIDTH)]
    warning = (doc.get("machine") or {}).get("warning")
    if warning:
        lines += textwrap.wrap(f"Warning: {warning}.", WIDTH)
    return lines + prefix_cache_line(result) + serving_line(result)


def serving_line(result: DemoResult) -> list[str]:
    """One line: each serving method's aggregate output tok/s and p50 TTFT at each level."""
    stage = result.stage("bench serving")
    rows = ((stage.document or {}) if stage else {}).get("rows", [])
    cells = {(r["method"], r["concurrency"]): r for r in rows if r.get("output_tok_s")}
    if not cells:
        return []

    def figures(method: str) -> str:
        found = [cells.get((method, level)) for level in SERVING_LEVELS]
        return " / ".join(
            f"{r['output_tok_s']:.0f} ({1000 * r['ttft_p50_s']:.0f})" if r else "-" for r in found
        )

    levels = " / ".join(f"c{level}" for level in SERVING_LEVELS)
    parts = "; ".join(f"{method} {figures(method)}" for method in SERVING_METHODS)
    return ["", *textwrap.wrap(f"Serving, tok/s (p50 TTFT ms) at {levels}: {parts}", WIDTH)]


def _agentic_turns(document: dict, method: str = AGENTIC_METHOD) -> list[dict]:
    rows = [r for r in document.get("rows", []) if r.get("turns")]
    row = next((r for r in rows if r["method"] == method), rows[0] if rows else None)
    return row["turns"] if row else []


def prefix_cache_line(result: DemoResult) -> list[str]:
    """One line: the agentic turns' time to first token, prefix cache on and off."""
    stage = result.stage("bench agentic")
    turns = _agentic_turns((stage.document or {}) if stage else {})
    if not turns:
        return []

    def ms(key: str) -> str:
        return "/".join("-" if not t[key] else f"{1000 * t[key]['median']:.0f}" for t in turns)

    line = f"Prefix cache, {AGENTIC_METHOD}, TTFT by turn: {ms('ttft_on_s')} ms; cache off: {ms('ttft_off_s')} ms"
    return ["", _fit(line)]


HEADER = "ddops demo: the incident, replayed on a simulated Proxmox VE host (CPU only)"


def story_lines(result: DemoResult) -> list[str]:
    """The demo's whole output: the stages, the boot-time repair, the bench, where things are."""
    lines = [
        HEADER,
        *(stage_line(stage) for stage in result.stages),
        *boot_story(result),
        *bench_story(result),
        "",
        f"site file: {result.workdir / 'site.yml'}",  # paths stay whole, whatever their length
    ]
    if result.report:
        lines += [f"report:    {result.report}", "           (CSV, JSON and plots beside it)"]
    if result.agentic_report:
        lines.append(f"agentic:   {result.agentic_report}")
    if result.stages:
        lines += [
            f"The simulated host stays up, CT {DEMO_VMID} serving. To remove it:",
            f"  ddops sim destroy {result.workdir / 'host'}",
        ]
    return lines
