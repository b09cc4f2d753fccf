"""engine/tools/gpu_batched.py on the CPU at tiny widths (--tiny): the scheduler driven at each
concurrency for each method, the figures it reports, the verify cost table, and its refusals.
On CUDA it runs at Qwen3.6-27B's widths (via engine/tools/gpu_check.py).

    python -m pytest -q tests/engine/tools/test_gpu_batched.py
"""

from __future__ import annotations

import pytest
import torch

from engine.decode import _Sequence
from engine.draft_passes import DraftPasses
from engine.scheduler import Scheduler
from engine.step_passes import StepPasses
from engine.tools import gpu_batched, gpu_check
from engine.tools.gpu_rounds import random_pair
from engine.tree_passes import TreePasses

METHODS = ("ar", "ddtree:15", "auto")


@pytest.fixture(scope="module")
def report() -> dict:
    return gpu_batched.check_batched(
        torch.device("cpu"), torch.float32, layers=1, prefix=40, new_tokens=6,
        concurrency=(1, 2), methods=METHODS, tiny=True,
    )  # fmt: skip


def test_every_method_at_every_concurrency_has_its_figures(report):
    assert [(row["method"], row["concurrency"]) for row in report["rows"]] == [
        ("ar", 1), ("ar", 2), ("ddtree:15", 1), ("ddtree:15", 2), ("auto", 1), ("auto", 2),
    ]  # fmt: skip
    for row in report["rows"]:
        assert row["tokens_per_s_1"] > 0 and row["tokens_per_s_2"] > 0
        assert 0 < row["itl_ms_p50_1"] <= row["itl_ms_max_1"]
        fitted = row["itl_ms_p50_64"]  # None where noise made the deeper stack faster
        assert fitted is None or (fitted > 0 and row["tokens_per_s_64"] > 0)


def test_the_verify_table_has_each_batch_of_ar_steps_and_of_trees(report):
    shapes = {(row["path"], row["sequences"], row["tokens"]) for row in report["verify_ms"]}
    # ar steps and 16-token trees; alone, a sequence verifies by generate()'s static passes
    expected = {("solo", 1, 1), ("solo", 1, 16), ("batched", 2, 2), ("batched", 2, 32)}
    assert expected <= shapes
    assert all(row["ms_1"] > 0 and row["ms_2"] > 0 for row in report["verify_ms"])
    tokens = [row["tokens"] for row in report["verify_ms"]]
    assert tokens == sorted(tokens)


def test_gpu_check_reports_each_method_s_batching_gain(report):
    figures = {f.name: f for f in gpu_check.figures(_gpu_check_report(report))}
    for method in METHODS:
        figure = figures[f"batched {method}: tok/s at 2 / at 1 (2 layers)"]
        assert figure.value > 0 and figure.target == "-" and figure.passed


@pytest.mark.parametrize(("graphed", "passed"), [(30.0, True), (18.0, False)])
@pytest.mark.parametrize("method", ["ar", "ddtree:15"])
def test_gpu_check_holds_graphed_steps_to_eager_s_speed(method, graphed, passed):
    def row(method: str, concurrency: int, rate: float) -> dict:
        return {"method": method, "concurrency": concurrency, "tokens_per_s_2": rate}

    rows = [row(method, 1, 10.0), row(method, 2, graphed), row(f"{method} eager", 1, 9.0)]
    batched = {"layers": 1, "rows": [*rows, row(f"{method} eager", 2, 20.0)]}
    figures = {f.name: f for f in gpu_check.batched_figures(batched)}
    figure = figures[f"batched {method}: steps graphed / eager at 2 (2 layers)"]
    assert figure.value == graphed / 20.0 and figure.passed is passed


def _gpu_check_report(batched: dict) -> dict:
    rows = [{"passed": True}]
    stack = {"triton: verify 16-token tree": 1.0, "triton: decode step": 1.0}
    return {"correctness": rows, "stack": stack, "recompiles": {}, "batched": batched}


def test_the_pass_timer_times_alike_decode_passes_and_restores_the_model():
    target, _ = random_pair(torch.device("cpu"), torch.float32, 1, tiny=True)
    scheduler_pass = type(target).forward_batch
    solo_verify = _Sequence.verify
    with gpu_batched.PassTimes(target) as passes:
        assert target.forward_batch != scheduler_pass.__get__(target)
        assert _Sequence.verify is not solo_verify
    assert "forward_batch" not in vars(target)  # the class's own again
    assert _Sequence.verify is solo_verify
    assert passes.table() == {}


def test_with_steps_graphed_each_method_runs_with_and_without_them_and_both_are_timed(
    monkeypatch,
):
    """What CUDA runs (plain and tree steps by their bucket's graph: engine/step_passes.py,
    engine/tree_passes.py), forced on the CPU: ar and ddtree are also measured with them off,
    and their passes are timed ("graphed")."""
    target, drafter = random_pair(torch.device("cpu"), torch.float32, 1, tiny=True)

    def with_steps(*args, **kwargs):
        scheduler = Scheduler(*args, **kwargs)
        scheduler.steps = StepPasses(target, graphs=False)
        scheduler.trees = TreePasses(target, graphs=False)
        scheduler.drafts = DraftPasses(drafter, target, graphs=False)
        return scheduler

    monkeypatch.setattr(gpu_batched, "Scheduler", with_steps)
    methods, levels = ("ar", "ddtree:3"), (1, 2)
    measured = gpu_batched.measure(target, drafter, methods, levels, prefix=40, new_tokens=6)
    names = [*methods, "ar eager", "ddtree:3 eager"]
    assert set(measured["runs"]) == {(name, level) for name in names for level in levels}
    assert ("graphed", 2, 2) in measured["passes"] and ("batched", 2, 2) in measured["passes"]
    assert ("graphed", 2, 8) in measured["passes"], measured["passes"]  # two trees of 4


def test_a_window_counts_only_the_tokens_every_sequence_decoded_in():
    stream = gpu_batched.Emissions([(1.0, 1), (2.0, 2), (3.0, 1), (4.0, 1)])
    assert stream.within(1.0, 3.0) == 3 and stream.itl_ms == pytest.approx(1000 * 3 / 4)


@pytest.mark.parametrize("method", ["beam", "ddtree:x", "ddtree:0"])
def test_a_bad_method_is_refused(method):
    with pytest.raises(ValueError, match="not a method"):
        gpu_batched.method_config(method, 8)


def test_without_cuda_the_tool_says_so_and_exits_2(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_batched.main([]) == 2
    assert "no CUDA device" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        gpu_batched.main(["--concurrency", "0,4"])
    assert exited.value.code == 2
