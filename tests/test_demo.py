"""`ddops demo` end to end: the README's main command, on a simulated host with the demo model.

Slow (a few minutes on 2 cores): CI runs it. It asserts the lifecycle's stages all succeed,
the report exists, and the drafter pays off as the demo pair should: more tokens committed per
round (tau, deterministic at temperature 0) for DDTree budget 15 than for the DFlash chain, and
for the chain than for autoregressive decoding. Speeds are printed, not asserted: tokens/s are
measured by benchmarks (see README), never by timed tests.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ops.bench.report import load_rows
from ops.sim.host import destroy_host
from ops.sim.state import is_sim_root

pytestmark = [pytest.mark.slow, pytest.mark.lxc]


@pytest.fixture
def demo_dir(tmp_path: Path) -> Iterator[Path]:
    """The demo's workdir; the simulated host it leaves up (by design) is destroyed after."""
    yield tmp_path / "demo"
    if is_sim_root(tmp_path / "demo" / "host"):
        destroy_host(tmp_path / "demo" / "host")


def test_demo_runs_the_lifecycle_and_ddtree_wins(demo_dir):
    proc = subprocess.run(
        [sys.executable, "-m", "ops.cli", "--json", "demo", "--workdir", str(demo_dir)],
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    document = json.loads(proc.stdout)
    stages = {s["name"]: s["exit_code"] for s in document["stages"]}
    assert list(stages) == [
        "sim init", "provision", "health", "sim reboot", "health after reboot", "recover", "bench"
    ]  # fmt: skip
    assert all(code == 0 for name, code in stages.items() if name != "health after reboot")
    report = Path(document["report"])
    assert report.is_file() and (report.parent / "results.csv").is_file()
    assert list((report.parent / "plots").glob("*.png"))
    rows = {row["method"]: row for row in load_rows(report.parent)}
    print("\ndemo decode tok/s:", {m: round(r["decode_tok_s"], 1) for m, r in rows.items()})
    tau = {method: row["tau"] for method, row in rows.items()}
    assert tau["ddtree:15"] > tau["linear"] > tau["ar"] == 1.0, tau
