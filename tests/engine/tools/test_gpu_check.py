"""The pure logic of engine/tools/gpu_check.py, which otherwise needs a GPU: each figure against
its target, engine/tools/gpu_rounds.py's figures among them."""

from __future__ import annotations

import json

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


TIE = {"method": "ar", "prompt": 1, "position": 51, "alone": 587, "batched": 968, "ulps": 1.0}
TIE |= {"alone_logit": 9.0625, "batched_logit": 9.125}
TIES = {
    "methods": {"ar": {"requests": 8, "equal": 7}},
    "divergences": [{**TIE, "near_tie": True}],
    "least_equal_share": 7 / 8,
}


def _report(failed: int = 0, verify_ms: float = 11.0, recompiles: int = 0, **extra) -> dict:
    rows = [{"passed": i >= failed} for i in range(10)]
    stack = {"triton: verify 16-token tree": verify_ms, "triton: decode step": 10.0}
    counts = {"growing slice": recompiles, "whole cache": 0}
    return {"correctness": rows, "stack": stack, "recompiles": counts, **extra}


def _verdicts(report: dict) -> dict[str, bool]:
    return {fig.name: fig.passed for fig in gpu_check.figures(report)}


def test_figures_meet_their_targets() -> None:
    memory = {"load_peak_ratio": 1.02, "prefill_peak_bytes": 9, "plan_total_bytes": 10}
    verdicts = _verdicts(_report(memory=memory, rounds=[ROUND_FIGURE], ties=TIES))
    assert verdicts == {
        "kernels vs references (failed)": True,
        "layer stack verify(16) / decode": True,
        "recompiles while the context grows": True,
        "load peak / weights": True,
        "prefill peak / plan": True,
        "host syncs per round": True,
        "batched vs alone at bf16: flips beyond a near-tie": True,
        "batched vs alone at bf16: least share equal": True,
    }


@pytest.mark.parametrize(
    ("report", "failing"),
    [
        (_report(failed=1), "kernels vs references (failed)"),
        (_report(verify_ms=11.6), "layer stack verify(16) / decode"),
        (_report(recompiles=1), "recompiles while the context grows"),
        (_report(rounds=[{**ROUND_FIGURE, "value": 5.0, "passed": False}]), "host syncs per round"),
        (
            _report(ties={**TIES, "divergences": [{**TIE, "ulps": 40.0, "near_tie": False}]}),
            "batched vs alone at bf16: flips beyond a near-tie",
        ),
        (
            _report(ties={**TIES, "least_equal_share": 1 / 8}),
            "batched vs alone at bf16: least share equal",
        ),
    ],
    ids=["kernel", "verify_ratio", "recompile", "rounds", "ties", "ties_share"],
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


def test_a_report_of_some_sections_gives_their_figures_and_one_failed_figure_a_missing_one():
    report = {
        "correctness": [{"passed": True}],
        "errors": {"memory": "RuntimeError: CUDA out of memory"},
        "skipped": ["batched"],
    }
    verdicts = {fig.name: (fig.value, fig.passed) for fig in gpu_check.figures(report)}
    assert verdicts == {
        "kernels vs references (failed)": (0, True),
        "section memory": ("raised RuntimeError: CUDA out of memory", False),
        "section batched": ("not started (deadline)", False),
    }


def fake_device(monkeypatch, **checks) -> None:
    """gpu_check's device and sections as on a GPU, each check answering at once (or as given)."""
    monkeypatch.setattr(gpu_check, "_no_device_reason", lambda: None)
    monkeypatch.setattr(gpu_check.torch.cuda, "get_device_name", lambda device: "fake GPU")
    answers = {
        "check_correctness": lambda device, prefix: [],
        "time_kernels": lambda device, prefix: {"tree attention": {"triton": 0.1}},
        "time_stack": lambda device, layers, prefix: _report()["stack"],
        "check_recompiles": lambda device: {"growing slice": 0, "whole cache": 0},
        "check_memory": lambda device, layers, prompt: {
            "load_peak_ratio": 1.01,
            "prefill_peak_bytes": 9,
            "plan_total_bytes": 10,
        },
        "check_rounds": lambda device, layers: [ROUND_FIGURE],
        "check_batched": lambda device, layers, prefix: {"layers": layers, "rows": []},
        "check_ties": lambda device_type: TIES,
    }
    for name, answer in {**answers, **checks}.items():
        monkeypatch.setattr(gpu_check, name, answer)
    monkeypatch.setattr(gpu_check, "print_memory_report", lambda memory: None)
    monkeypatch.setattr(gpu_check, "print_batched", lambda batched: None)


def test_a_section_that_raises_fails_the_run_but_the_others_are_kept(tmp_path, monkeypatch, capsys):
    def out_of_memory(device, layers, prompt):
        raise RuntimeError("CUDA out of memory")

    fake_device(monkeypatch, check_memory=out_of_memory)
    out = tmp_path / "gpu_check.json"
    assert gpu_check.main(["--out", str(out), "--skip", "batched"]) == 1
    report = json.loads(out.read_text())
    assert [name for name in gpu_check.SECTIONS if name in report] == [
        "correctness",
        "kernels",
        "stack",
        "recompiles",
        "rounds",
        "ties",
    ]
    assert report["errors"] == {"memory": "RuntimeError: CUDA out of memory"}
    failed = [fig["name"] for fig in report["figures"] if not fig["passed"]]
    assert failed == ["section memory"]
    assert "FAIL section memory" in capsys.readouterr().out


def test_every_section_met_is_exit_0_and_only_runs_the_named_ones(tmp_path, monkeypatch):
    fake_device(monkeypatch)
    assert gpu_check.main([]) == 0
    out = tmp_path / "gpu_check.json"
    assert gpu_check.main(["--out", str(out), "--only", "stack,correctness"]) == 0
    report = json.loads(out.read_text())
    assert [name for name in gpu_check.SECTIONS if name in report] == ["correctness", "stack"]


@pytest.mark.parametrize(
    "argv",
    [
        ["--only", "kernels,warp"],
        ["--only", "stack", "--skip", "memory"],
        ["--layers", "0"],
        ["--deadline", "soon"],
        ["--out", "/no/such/directory/gpu_check.json"],
    ],
)
def test_bad_arguments_exit_2_before_any_device_work(argv, monkeypatch, capsys):
    fake_device(monkeypatch, check_correctness=lambda device, prefix: pytest.fail("ran"))
    with pytest.raises(SystemExit) as exited:
        gpu_check.main(argv)
    assert exited.value.code == 2
    assert "error:" in capsys.readouterr().err
