"""The step runner: statuses, dry-run wording, stop at the first failure, timing."""

from __future__ import annotations

from rich.console import Console

from ops.errors import DdopsError
from ops.steps import Outcome, render_table, results_json, run_steps


def boom(dry_run: bool) -> Outcome:
    raise DdopsError("CT 200", "is locked (backup)")


def test_statuses_and_stop_at_first_failure():
    calls = []

    def changed(dry_run):
        calls.append(dry_run)
        return Outcome(True, "wrote 2 lines", diff="+dev0: /dev/nvidia0")

    steps = [("a", changed), ("b", lambda d: Outcome(False)), ("c", boom), ("d", changed)]
    seen = []
    results = run_steps(steps, on_result=seen.append)
    assert [(r.step, r.status) for r in results] == [
        ("a", "changed"),
        ("b", "unchanged"),
        ("c", "failed"),
        ("d", "skipped"),
    ]
    assert results[2].detail == "CT 200: is locked (backup)"
    assert seen == results and calls == [False]
    dry = run_steps(steps[:2], dry_run=True)
    assert [r.status for r in dry] == ["would change", "unchanged"] and calls == [False, True]
    assert results_json(dry)[0]["diff"] == "+dev0: /dev/nvidia0"


def test_table_shows_every_step_and_the_diff():
    console = Console(record=True, width=120)
    render_table(
        "provision CT 200",
        run_steps([("host: modules", lambda d: Outcome(True, "loaded nvidia_uvm", "+nvidia_uvm"))]),
        console,
    )
    text = console.export_text()
    assert (
        "host: modules" in text
        and "changed" in text
        and "loaded nvidia_uvm" in text
        and "+nvidia_uvm" in text
    )
