"""`ddops demo` end to end: the README's main command, on a simulated host with the demo model.

Slow (a few minutes on 2 cores): CI runs it. It runs the demo as a user does (in a pipe, so plain
lines) and asserts: every stage succeeds; the output fits one screen (<= 60 lines of <= 100
columns) and tells the incident's story (the boot-time recovery re-granted the moved uvm major and
re-staged /dev/shm from the CT's cache, downloading nothing); it ends with the bench table and
the report; DDTree ran at several budgets and the drafter pays off as the demo pair should: more
tokens committed per round (tau, deterministic at temperature 0) for larger DDTree budgets than
for the DFlash chain, and for the chain than for autoregressive decoding. The bench is honest:
every speedup has its interval, none exceeds its tau, and the verdict names a winner only when
its interval clears the others'. The agentic stage reports each turn's time to first token with
the prefix cache on and off; the serving stage, aggregate tok/s and p50 TTFT at 1 and 4 clients. Speeds are printed, not asserted: tokens/s are measured by
benchmarks (see README), never by timed tests.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from ops.bench.report import load_rows
from ops.sim.host import destroy_host
from ops.sim.state import is_sim_root

pytestmark = [pytest.mark.slow, pytest.mark.lxc]


@pytest.fixture
def demo_dir() -> Iterator[Path]:
    """The demo's workdir, a path as short as a user's default (its report path must fit 100
    columns); the simulated host it leaves up (by design) is destroyed after."""
    top = Path(tempfile.mkdtemp(prefix="dd", dir="/tmp"))
    yield top / "demo"
    if is_sim_root(top / "demo" / "host"):
        destroy_host(top / "demo" / "host")
    shutil.rmtree(top, ignore_errors=True)


def test_demo_tells_the_incident_in_one_screen_and_ddtree_wins(demo_dir):
    proc = subprocess.run(
        [sys.executable, "-m", "ops.cli", "demo", "--workdir", str(demo_dir)],
        capture_output=True,
        text=True,
        timeout=1500,
        env={**os.environ, "COLUMNS": "100"},
    )
    assert proc.returncode == 0, proc.stderr[-4000:] + proc.stdout[-4000:]
    print("\n" + proc.stdout)
    lines = proc.stdout.splitlines()
    assert len(lines) <= 60 and max(map(len, lines)) <= 100
    assert not proc.stderr.strip(), proc.stderr  # no progress bars or tables in a pipe
    stages = [line.split()[0:2] for line in lines[1:10]]
    assert [" ".join(words) for words in stages] == [
        "sim init", "provision CT", "health CT", "sim reboot", "health after", "recover CT",
        "bench 6", "bench agentic", "bench serving",
    ]  # fmt: skip
    story = "\n".join(lines)
    assert "uvm 511 -> 509" in story
    assert "The reboot, repaired at boot by ddops-recover.service with nobody acting:" in story
    assert "  CT config grants current majors\n" in story
    assert "0 file(s) from the hub" in story and "0 bytes downloaded from the hub" in story
    report = Path(next(line for line in lines if line.startswith("report: ")).split()[1])
    assert lines[-1] == f"  ddops sim destroy {demo_dir / 'host'}"
    assert report.is_file() and (report.parent / "results.csv").is_file()
    assert {p.name for p in (report.parent / "plots").glob("*.png")} == {
        "speedup_by_method_length.png",
        "tau_tok_s_by_budget.png",
    }
    rows = {row["method"]: row for row in load_rows(report.parent)}
    assert set(rows) == {"ar", "linear", "ddtree:4", "ddtree:8", "ddtree:15", "ddtree:32"}
    tau = {method: row["tau"] for method, row in rows.items()}
    assert tau["ddtree:15"] > tau["linear"] > tau["ar"] == 1.0, tau
    for row in rows.values():
        assert row["repeats"] >= 3 and row["speedup_low"] <= row["speedup"] <= row["speedup_high"]
        assert row["speedup"] <= row["tau"] * 1.1, row
    verdict = r"^Verdict: (\S+ wins: \d+\.\d\dx \(|ar wins|no clear winner at this noise)"
    assert re.search(verdict, story, re.MULTILINE), story
    assert re.search(r"\d+\.\d\dx \(\d+\.\d\d-\d+\.\d\d\)$", story, re.MULTILINE), story
    agentic = Path(next(line for line in lines if line.startswith("agentic: ")).split()[1])
    turns = next(r for r in load_rows(agentic.parent) if r["method"] == "ddtree:15")["turns"]
    assert len(turns) == 4 and all(t["ttft_on_s"] and t["ttft_off_s"] for t in turns)
    assert re.search(r"^Prefix cache, ddtree:15, TTFT by turn: (\d+/){3}\d+ ms", story, re.M)
    serving = r"Serving, tok/s \(p50 TTFT ms\) at c1 / c4: ar \d+ \(\d+\) / \d+ \(\d+\); ddtree:15"
    assert re.search(serving, " ".join(lines)), story
