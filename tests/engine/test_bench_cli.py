"""`python -m engine bench`: the summary arithmetic (paired speedups with intervals, the tau bound,
from engine/bench_stats.py), and a whole run on a tiny random hybrid pair.

python -m pytest -q tests/engine/test_bench_cli.py
"""

from __future__ import annotations

import argparse
import json
from types import SimpleNamespace

import pytest

from engine.__main__ import main
from engine.cli.bench import (
    Method,
    Tally,
    disturbed_in,
    format_table,
    methods_for,
    parse_budgets,
    parse_levels,
    run_verdict,
    summarise,
)
from engine.tools.arguments import positive_int, seconds
from tests.helpers.tiny_hybrid import save_tiny_hybrid, save_tiny_hybrid_drafter, torch_threads


def test_budgets_parse_and_reject_bad_input():
    assert parse_budgets("4,8,15") == [4, 8, 15]
    for bad in ("", "4,x", "0,4"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_budgets(bad)


def test_repeats_and_budget_must_be_valid():
    assert positive_int("3") == 3 and seconds("0") == 0.0 and seconds("2.5") == 2.5
    for bad in ("0", "-1", "x", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            positive_int(bad)
    for bad in ("-1", "x", "nan"):
        with pytest.raises(argparse.ArgumentTypeError):
            seconds(bad)


def test_a_repeat_whose_speedup_beats_tau_is_disturbed():
    ar, tree = Method("ar"), Method("ddtree", 15)

    def result(rate: float, lengths: list[int]) -> SimpleNamespace:
        return SimpleNamespace(decode_tokens_per_s=rate, acceptance_lengths=lengths)

    honest = {ar: result(10.0, [1] * 8), tree: result(25.0, [3, 3])}
    assert disturbed_in(honest, ar) == []
    stalled = {ar: result(1.0, [1] * 8), tree: result(25.0, [3, 3])}  # 25x with tau 3
    assert disturbed_in(stalled, ar) == ["ddtree 15"]


def test_methods_are_ar_first_then_linear_then_each_budget():
    assert [m.label for m in methods_for([4, 15])] == ["ar", "linear", "ddtree 4", "ddtree 15"]


def test_tally_weights_speed_by_time_and_tau_by_rounds():
    tally = Tally()
    tally.add([1, 3], decode_tokens_per_s=4.0)  # 4 tokens in 1 s
    tally.add([4, 4], decode_tokens_per_s=2.0)  # 8 tokens in 4 s
    assert tally.tau == 12 / 4
    assert tally.round_ms == 1000 * 5 / 4  # 5 s of decoding over 4 rounds


def test_summary_speedup_is_the_median_of_paired_ratios_and_the_table_shows_its_interval():
    ar, tree = Tally(), Tally()
    ar.add([1] * 10, decode_tokens_per_s=10.0, stage_seconds={"verify": 0.8, "commit": 0.1})
    tree.add([5, 5], decode_tokens_per_s=30.0, stage_seconds={"draft": 0.1, "verify": 0.2})
    # (prompt, repeat) -> tok/s: the ratios pair the same prompt and repeat: 3.0, 2.5, 3.2
    rates = {
        Method("ar"): {(0, 1): 10.0, (0, 2): 12.0, (1, 1): 10.0},
        Method("ddtree", 15): {(0, 1): 30.0, (0, 2): 30.0, (1, 1): 32.0},
    }
    rows = summarise({Method("ar"): ar, Method("ddtree", 15): tree}, rates)
    assert [(r["method"], r["budget"], r["tau"], r["speedup"]) for r in rows] == [
        ("ar", None, 1.0, 1.0),
        ("ddtree", 15, 5.0, 3.0),
    ]
    assert (rows[1]["speedup_low"], rows[1]["speedup_high"], rows[1]["repeats"]) == (2.5, 3.2, 3)
    assert (rows[1]["decode_tokens_per_s"], rows[1]["decode_tokens_per_s_low"]) == (30.0, 30.0)
    # 10 tokens in 1/3 s over 2 rounds: a round costs 1/6 s, 5/3 of ar's 1/10 s step
    assert rows[1]["round_ms"] == pytest.approx(1000 / 6, abs=1e-3)
    assert rows[1]["cost"] == pytest.approx(5 / 3, abs=1e-3)
    assert rows[1]["stage_ms"] == {"draft": 50.0, "tree": 0.0, "verify": 100.0, "commit": 0.0}
    lines = format_table(rows).splitlines()
    assert lines[0].split()[-4:] == ["draft", "ms", "verify", "ms"]
    assert lines[1].split() == ["ar", "1.00", "10.0", "1.00x", "1.00", "0.00", "80.00"]
    assert lines[2].split() == [
        *("ddtree", "15", "5.00", "30.0", "3.00x", "(2.50-3.20)"),
        *("1.67", "50.00", "100.00"),
    ]
    assert run_verdict(rows)["winner"] == "ddtree 15"


def test_bench_runs_every_method_and_ends_with_one_json_document(tmp_path, capsys):
    target = save_tiny_hybrid(tmp_path / "target", seed=0)
    draft = save_tiny_hybrid_drafter(tmp_path / "draft", target, seed=1)
    argv = ["bench", "--model", str(target), "--draft", str(draft), "--budgets", "3,6"]
    with torch_threads(1):
        rc = main(
            [*argv, "--max-new-tokens", "6", "--prompts", "2", "--repeats", "2"]
            + ["--time-budget", "0"]
        )
    assert rc == 0
    out = capsys.readouterr().out.strip().splitlines()
    report = json.loads(out[-1])
    assert report["prompts"] == 2 and report["max_new_tokens"] == 6 and report["repeats"] == 2
    assert report["time_budget_s"] == 0 and report["verdict"]["text"]
    assert report["machine"]["cpus"] >= 1 and report["machine"]["load_end"]
    assert 0 <= report["machine"]["others_cpu"] <= 1
    rows = report["results"]
    assert [(r["method"], r["budget"]) for r in rows] == [
        ("ar", None),
        ("linear", None),
        ("ddtree", 3),
        ("ddtree", 6),
    ]
    # every method decodes 5 tokens (the prefill's token is not decoded) in each clean repeat:
    # 2 prompts x 2 (a disturbed repeat is redone, at worst given up: a busy machine)
    (repeats,) = {r["repeats"] for r in rows}
    assert 2 <= repeats <= 4 and {r["tokens"] for r in rows} == {5 * repeats}
    assert rows[0]["tau"] == 1.0 and rows[0]["speedup"] == 1.0
    assert all(r["speedup"] <= r["tau"] * 1.1 for r in rows)
    assert all(r["decode_tokens_per_s"] > 0 and r["tau"] >= 1.0 for r in rows)
    assert rows[0]["cost"] == 1.0 and rows[0]["stage_ms"]["draft"] == 0.0  # ar drafts nothing
    assert all(r["stage_ms"]["draft"] > 0 and r["stage_ms"]["verify"] > 0 for r in rows[1:])
    assert any(line.split()[:2] == ["ddtree", "6"] for line in out[:-1])  # the table


def test_bench_at_concurrency_decodes_copies_of_each_prompt_at_once(tmp_path, capsys):
    """--concurrency 1,2: after the one-at-a-time table, each method decodes two copies of each
    prompt at once through the scheduler; aggregate tok/s and the paired speedup over ar."""
    target = save_tiny_hybrid(tmp_path / "target", seed=0)
    draft = save_tiny_hybrid_drafter(tmp_path / "draft", target, seed=1)
    argv = ["bench", "--model", str(target), "--draft", str(draft), "--budgets", "3"]
    with torch_threads(1):
        rc = main(
            [*argv, "--max-new-tokens", "6", "--prompts", "1", "--repeats", "2"]
            + ["--time-budget", "0", "--concurrency", "2,1"]
        )
    assert rc == 0
    out = capsys.readouterr().out.strip().splitlines()
    report = json.loads(out[-1])
    assert report["concurrency_levels"] == [1, 2]
    rows = report["concurrency"]
    assert [(r["method"], r["budget"], r["concurrency"]) for r in rows] == [
        ("ar", None, 2),
        ("linear", None, 2),
        ("ddtree", 3, 2),
    ]
    assert rows[0]["speedup"] == 1.0 and all(r["tokens_per_s"] > 0 for r in rows)
    assert "2 sequences at once (aggregate tok/s, prefill included):" in out


def test_decoding_at_once_counts_every_sequences_tokens():
    from engine.cli.bench import decode_at_once

    class OneStep:
        idle = False

        def add(self, request):
            self.requests = [*getattr(self, "requests", []), request]

        def step(self):
            for request in self.requests:
                result = SimpleNamespace(output_ids=[1, 2, 3], acceptance_lengths=[1, 2])
                request.on_finish(SimpleNamespace(result=result, error=None))
            self.idle = True

    done = decode_at_once(OneStep(), cfg=None, prompt=[5, 6], n=3)
    assert done.acceptance_lengths == [1, 2] * 3 and done.decode_tokens_per_s > 0


def test_concurrency_levels_parse():
    assert parse_levels("4,1,4") == [1, 4]
    for bad in ("0", "x", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_levels(bad)
