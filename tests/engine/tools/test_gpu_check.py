"""The pure logic of engine/tools/gpu_check.py, which otherwise needs a GPU: each figure against
its target, engine/tools/gpu_rounds.py's figures among them."""

from __future__ import annotations

import pytest

from engine.tools import gpu_check

ROUND_FIGURE = {
    "name": "host syncs per round",
    "value": 3.0,
    "limit": 3,
    "unit": "",
    "passed": True,
}
UNTARGETED = {
    "name": "ar step ms (64 layers)",
    "value": 12.5,
    "limit": None,
    "unit": " ms",
    "passed": True,
}


def _report(failed: int = 0, verify_ms: float = 11.0, recompiles: int = 0, **extra) -> dict:
    rows = [{"passed": i >= failed} for i in range(10)]
    stack = {"triton: verify 16-token tree": verify_ms, "triton: decode step": 10.0}
    counts = {"growing slice": recompiles, "whole cache": 0}
    return {"correctness": rows, "stack_ms": stack, "recompiles": counts, **extra}


def _verdicts(report: dict) -> dict[str, bool]:
    return {fig.name: fig.passed for fig in gpu_check.figures(report)}


def test_figures_meet_their_targets() -> None:
    memory = {"load_peak_ratio": 1.02, "prefill_peak_bytes": 9, "plan_total_bytes": 10}
    verdicts = _verdicts(_report(memory=memory, rounds=[ROUND_FIGURE]))
    assert verdicts == {
        "kernels vs references (failed)": True,
        "layer stack verify(16) / decode": True,
        "recompiles while the context grows": True,
        "load peak / weights": True,
        "prefill peak / plan": True,
        "host syncs per round": True,
    }


@pytest.mark.parametrize(
    ("report", "failing"),
    [
        (_report(failed=1), "kernels vs references (failed)"),
        (_report(verify_ms=11.6), "layer stack verify(16) / decode"),
        (_report(recompiles=1), "recompiles while the context grows"),
        (_report(rounds=[{**ROUND_FIGURE, "value": 5.0, "passed": False}]), "host syncs per round"),
    ],
    ids=["kernel", "verify_ratio", "recompile", "rounds"],
)
def test_a_missed_target_fails_its_figure_only(report: dict, failing: str) -> None:
    verdicts = _verdicts(report)
    assert [name for name, ok in verdicts.items() if not ok] == [failing]


def test_round_figures_keep_their_limits_and_units() -> None:
    by_name = {f.name: f for f in gpu_check.figures(_report(rounds=[ROUND_FIGURE, UNTARGETED]))}
    assert (by_name["host syncs per round"].target, by_name["host syncs per round"].value) == (
        "<= 3",
        3.0,
    )
    untargeted = by_name["ar step ms (64 layers)"]
    assert (untargeted.target, untargeted.unit, untargeted.passed) == ("-", "ms", True)
