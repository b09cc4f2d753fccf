"""`ddops demo`: the whole lifecycle on a simulated Proxmox host, on this machine's CPU.

    sim init -> provision (the demo model pair, served by a local hub) -> health
    -> sim reboot (the uvm major moves, /dev/shm empties) -> health -> recover -> bench

Every stage runs the real `ddops` command in-process against a site file the demo writes
(WORKDIR/site.yml), so what the demo shows is exactly what a user runs. The sim host,
the hub's repos, the results and the report all live under WORKDIR.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ops.errors import DdopsError
from ops.site import DEMO_MODEL_DIR, DEMO_REPOS

DEMO_VMID = 200
INCIDENT_UVM_MAJORS = (511, 509)  # before and after the reboot, as in the incident report
BENCH_METHODS = "ar,linear,ddtree:15"
BENCH_LENGTHS = "128"


@dataclass
class Stage:
    name: str
    argv: list[str]
    exit_code: int = 0
    seconds: float = 0.0
    may_fail: bool = False  # health right after the reboot is expected to fail


@dataclass
class DemoResult:
    workdir: Path
    stages: list[Stage] = field(default_factory=list)
    report: Path | None = None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def hub_root(workdir: Path) -> Path:
    """WORKDIR/hub/<org>/<name> links to the shipped demo model pair."""
    root = workdir / "hub"
    for part, repo in DEMO_REPOS.items():
        link = root / repo
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.is_symlink():
            link.symlink_to(DEMO_MODEL_DIR / part)
    return root


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
        Stage("health after reboot", [*inv, "health", "--ct", ct], may_fail=True),
        Stage("recover", [*inv, "recover", "--ct", ct]),
        Stage("bench", [*inv, "bench", "--ct", ct, "--methods", BENCH_METHODS,
                        "--lengths", BENCH_LENGTHS]),
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
    stage: Stage, invoke: Callable[[Sequence[str]], int], announce: Callable[[str], None]
) -> None:
    announce(f"\n=== ddops {' '.join(stage.argv)}")
    start = time.monotonic()
    stage.exit_code = invoke(stage.argv)
    stage.seconds = time.monotonic() - start
    if stage.exit_code != 0 and not stage.may_fail:
        raise DdopsError("demo", f"stage '{stage.name}' failed (exit {stage.exit_code}); see above")


def run_demo(
    workdir: Path, invoke: Callable[[Sequence[str]], int], *, quiet_stdout: bool
) -> DemoResult:
    """Run every stage; stdout of the stages goes to stderr when the caller prints JSON."""
    from ops.sim.host import destroy_host
    from ops.sim.hub import LocalHub
    from ops.sim.state import is_sim_root

    if not (DEMO_MODEL_DIR / "target" / "config.json").is_file():
        raise DdopsError(str(DEMO_MODEL_DIR), "the demo model pair is missing from this install")
    workdir = workdir.resolve()
    sim_root = workdir / "host"
    if is_sim_root(sim_root):
        destroy_host(sim_root)  # a fresh host each run: the demo tells the whole story
    workdir.mkdir(parents=True, exist_ok=True)
    result = DemoResult(workdir)
    out = sys.stderr if quiet_stdout else sys.stdout
    announce = lambda text: print(text, file=out, flush=True)  # noqa: E731
    results = workdir / "results"  # the chain's stale-run check and the bench share it
    with (
        LocalHub(hub_root(workdir)) as hub,
        contextlib.redirect_stdout(out),
        _environment(DDOPS_RESULTS=str(results)),
    ):
        site = workdir / "site.yml"
        site.write_text(
            yaml.safe_dump(site_document(sim_root, hub.url, free_port()), sort_keys=False)
        )
        announce(f"demo site file: {site} (local hub at {hub.url})")
        for stage in stages(workdir, site):
            result.stages.append(stage)
            run_stage(stage, invoke, announce)
    reports = sorted(results.glob("*/report.md"))
    result.report = reports[-1] if reports else None
    return result


def summary_lines(result: DemoResult) -> list[str]:
    lines = ["", "demo stages:"]
    lines += [f"  {s.name:<20} exit {s.exit_code}  {s.seconds:6.1f}s" for s in result.stages]
    if result.report:
        lines.append(f"report: {result.report} (CSV, JSON and plots beside it)")
    if result.stages:
        host = result.workdir / "host"
        lines.append(
            f"the simulated host stays up (CT {DEMO_VMID} and its engine): "
            f"`ddops sim destroy {host}` removes it"
        )
    return lines
