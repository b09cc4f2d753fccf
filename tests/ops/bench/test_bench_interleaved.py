"""The bench's rules on a busy machine (issue 31), over a scripted engine on a scripted clock:
methods interleaved and rotated, repeats sized to a time budget, paired speedups with their
intervals in every output, an honest verdict, disturbed repeats (speedup above tau) redone and
left out, the machine's state recorded, reasoning tokens counted, and the agentic scenario's
turns with the prefix cache on and off (issue 29, Must 5).

    python -m pytest -q tests/ops/bench/test_bench_interleaved.py
"""

from __future__ import annotations

import csv
import io
import json
import time

import httpx
import pytest
from click.testing import CliRunner

from engine.bench_stats import TAU_SLACK
from engine.machine_state import QUIET_PATIENCE, QUIET_TRIES, local_read
from ops.bench.client import EngineClient
from ops.bench.endpoint import Endpoint
from ops.bench.figures import rows_from_cells, verdicts
from ops.bench.matrix import AgenticShape, BenchConfig, parse_methods
from ops.bench.report import render_report
from ops.bench.runner import NullProgress, run_bench
from ops.cli import cli
from ops.commands.bench import _watch
from ops.results import RunStore
from tests.helpers import DATA
from tests.helpers.bench_engine import (
    BenchEngine,
    Bursts,
    ScriptedClock,
    ScriptedMachine,
    word_count,
)

GOLDEN_MARKDOWN = DATA / "bench" / "report-scripted.md"
# Per-round seconds and tokens per round of the scripted methods: ddtree:15's 3 tokens a round
# at 1.5x ar's step is a 2x speedup, ddtree:8's 2 at 1.25x is 1.6x, linear's 2 at 1.3x ~1.54x.
STEPS = {"ar": 0.020, "linear": 0.026, "ddtree:8": 0.025, "ddtree:15": 0.030}
TAUS = {"ar": 1.0, "linear": 2.0, "ddtree:8": 2.0, "ddtree:15": 3.0}


def jitter(n: int, body: dict) -> float:
    """A deterministic +-6% per request: what a quiet machine's timing looks like."""
    return 1.0 + 0.03 * ((n * 7) % 5 - 2)


def bench(tmp_path, config: BenchConfig, engine: BenchEngine, others: float = 0.05):
    store = RunStore.open(tmp_path / "results", {"bench": config.to_json()}, {})
    machine = ScriptedMachine(engine, others=others)
    return run_bench(config, engine.client(), store, NullProgress(), machine.watch())


def config_of(methods: str, **fields) -> BenchConfig:
    return BenchConfig(parse_methods(methods), **{"lengths": (16,), "warmup": 0, **fields})


def sent(engine: BenchEngine) -> list[str]:
    return [
        b["speculative"]["method"]
        + (f":{b['speculative']['budget']}" if "budget" in b["speculative"] else "")
        for b in engine.completions
    ]


def test_each_repeat_runs_every_method_back_to_back_in_rotated_order(tmp_path):
    engine = BenchEngine(step_s=STEPS, tau=TAUS)
    bench(tmp_path, config_of("ar,linear,ddtree:15", repeats=3, time_budget_s=0), engine)
    assert sent(engine) == [
        *("ar", "linear", "ddtree:15"),
        *("linear", "ddtree:15", "ar"),
        *("ddtree:15", "ar", "linear"),
    ]


def test_a_scripted_run_renders_the_golden_report_with_intervals_and_verdicts(tmp_path):
    engine = BenchEngine(max_model_len=2048, step_s=STEPS, tau=TAUS, slowdown=jitter)
    config = config_of(
        "ar,linear,ddtree:8,ddtree:15",
        scenarios=("decode", "agentic"),
        lengths=(16, 32),
        repeats=5,
        time_budget_s=0,
        agentic=AgenticShape(context=1000, turns=3),
    )
    result = bench(tmp_path, config, engine)
    run = result.run_dir
    files = render_report(run)
    text = files.markdown.read_text().replace(run.name, "RUN")
    assert text == GOLDEN_MARKDOWN.read_text()
    assert {p.name for p in files.plots} == {
        "speedup_by_method_length.png",
        "tau_tok_s_by_budget.png",
        "agentic_ttft_by_turn.png",
    }
    table = list(csv.DictReader(io.StringIO(files.csv.read_text())))
    tree = next(
        r
        for r in table
        if (r["method"], r["scenario"], r["length"]) == ("ddtree:15", "decode", "16")
    )
    assert float(tree["speedup_low"]) < float(tree["speedup"]) < float(tree["speedup_high"])
    document = json.loads(files.json.read_text())
    assert document["machine"]["others_cpu"] == pytest.approx(0.05, abs=0.01)
    assert [v["winner"] for v in document["verdicts"]] == ["ddtree:15"] * 4


def test_the_verdict_names_no_winner_when_the_leaders_intervals_overlap(tmp_path):
    close = {**STEPS, "ddtree:8": 0.0195, "ddtree:15": 0.0300}  # 2.05x and 2.0x
    engine = BenchEngine(step_s=close, tau=TAUS, slowdown=jitter)
    result = bench(tmp_path, config_of("ar,ddtree:8,ddtree:15", repeats=5, time_budget_s=0), engine)
    (found,) = verdicts(rows_from_cells(result.cells))
    assert found["winner"] is None and set(found["leaders"]) == {"ddtree:8", "ddtree:15"}
    assert found["text"].startswith("no clear winner at this noise (intervals overlap): leaders")


def test_a_repeat_whose_speedup_beats_tau_is_marked_disturbed_redone_and_left_out(tmp_path):
    """Issue 31's incident: ar slowed 10x by another process in one repeat gives ddtree a
    speedup far above its tau. That repeat is redone; no reported speedup exceeds tau."""

    def stall(n: int, body: dict) -> float:
        return 10.0 if n == 6 else 1.0  # repeat 1: linear, ddtree:15, then ar (the 6th)

    engine = BenchEngine(step_s=STEPS, tau=TAUS, slowdown=stall)
    result = bench(tmp_path, config_of("ar,linear,ddtree:15", repeats=3, time_budget_s=0), engine)
    cells = {c["cell"]["method"]: c for c in result.cells}
    assert cells["ar"]["disturbed_repeats"] == 1 and result.machine["disturbed_repeats"] == 1
    marked = [s["repeat"] for s in cells["ddtree:15"]["samples"] if s["disturbed"]]
    assert marked == [1] and len(cells["ddtree:15"]["samples"]) == 4
    rows = {r["method"]: r for r in rows_from_cells(result.cells)}
    assert rows["ddtree:15"]["repeats"] == 3 and rows["ddtree:15"]["disturbed"] == 1
    for row in rows.values():
        assert row["speedup_high"] <= row["tau"] * (1 + TAU_SLACK)
    assert rows["ddtree:15"]["speedup"] == pytest.approx(2.0)
    assert "1 repeat disturbed (speedup above tau), redone" in result.machine["warning"]


def test_the_time_budget_buys_repeats_beyond_the_minimum(tmp_path):
    engine = BenchEngine(step_s=STEPS, tau=TAUS)
    # A repeat of ar + ddtree:15 at 16 tokens: 15 * 0.02 + 5 * 0.03 + 2 prefills = 0.51 s, so
    # a 2.2 s budget has room for a third and a fourth (2.04 s), not a fifth.
    config = config_of("ar,ddtree:15", repeats=2, max_repeats=20, time_budget_s=2.2)
    result = bench(tmp_path, config, engine)
    assert {c["cell"]["method"]: len(c["samples"]) for c in result.cells} == {
        "ar": 4,
        "ddtree:15": 4,
    }
    capped = config_of("ar,ddtree:15", repeats=2, max_repeats=3, time_budget_s=100.0)
    result = bench(tmp_path / "capped", capped, BenchEngine(step_s=STEPS, tau=TAUS))
    assert {len(c["samples"]) for c in result.cells} == {3}


def test_requests_disturbed_by_bursts_are_sent_again_so_the_speedup_stays_the_quiet_ones(tmp_path):
    """Issue 31's busy machine: other processes take both cores 40% of the time, and a request
    that starts in a burst runs 4x slower. Each request measured busy is sent again after the
    burst, so the speedup is the quiet machine's 2.0x, not whatever the bursts made of it."""
    clock, bursts = ScriptedClock(), Bursts(period_s=1.0, busy_s=0.4)

    def during_a_burst(n: int, body: dict) -> float:
        return 4.0 if bursts.busy_at(clock.now) else 1.0

    engine = BenchEngine(clock=clock, step_s=STEPS, tau=TAUS, slowdown=during_a_burst)
    config = config_of("ar,ddtree:15", repeats=8, time_budget_s=0)
    store = RunStore.open(tmp_path / "results", {"bench": config.to_json()}, {})
    watch = ScriptedMachine(engine, others=bursts).watch()
    result = run_bench(config, engine.client(), store, NullProgress(), watch)
    samples = [s for c in result.cells for s in c["samples"]]
    assert any(s["tries"] > 1 for s in samples)  # the bursts did land on requests
    assert all(s["quiet"] for s in samples) and result.machine["busy_requests"] == 0
    rows = {r["method"]: r for r in rows_from_cells(result.cells)}
    tree = rows["ddtree:15"]  # sent once each, the interval would reach down to 0.5x
    for figure in ("speedup", "speedup_low", "speedup_high"):
        assert tree[figure] == pytest.approx(2.0, rel=0.05), figure


def test_a_machine_that_is_never_quiet_is_measured_as_it_is(tmp_path):
    """After QUIET_PATIENCE requests in a row measured busy, no more waiting or re-sending:
    each request is sent once, kept, and counted in the warning."""
    engine = BenchEngine(step_s=STEPS, tau=TAUS)
    config = config_of("ar,ddtree:15", repeats=3, time_budget_s=0)
    result = bench(tmp_path, config, engine, others=0.6)
    requests = 2 * 3  # every method once a repeat
    assert len(engine.completions) == QUIET_PATIENCE * QUIET_TRIES + requests - QUIET_PATIENCE
    assert result.machine["busy_requests"] == requests
    assert (
        f"{requests} requests measured while other processes took the cores"
        in (result.machine["warning"])
    )


def test_a_busy_machine_is_recorded_and_warned_about(tmp_path):
    engine = BenchEngine(step_s=STEPS, tau=TAUS)
    result = bench(tmp_path, config_of("ar,ddtree:15", repeats=2, time_budget_s=0), engine, 0.6)
    assert result.machine["others_cpu"] == pytest.approx(0.6, abs=0.01)
    assert result.machine["cpus"] == 2 and result.machine["load_end"][0] == pytest.approx(2.2)
    assert result.machine["warning"].startswith("the machine was busy: other processes used 60%")
    manifest = RunStore.load(result.run_dir).manifest
    assert manifest["machine"] == json.loads(json.dumps(result.machine))
    every = [s["others_cpu"] for c in result.cells for s in c["samples"]]
    assert every and all(share == pytest.approx(0.6, abs=0.03) for share in every)  # jiffies


def test_own_cpu_is_the_engines_from_its_metrics_and_the_benchs_when_it_runs_there():
    """`ddops bench`'s watch: the engine's process_cpu_seconds_total, plus this process's CPU
    time when the engine runs on this machine; unknown when /metrics does not say."""
    engine = BenchEngine(step_s=STEPS, tau=TAUS)
    engine.cpu_s = 2.5
    with engine.client() as client:
        assert client.engine_cpu_seconds() == 2.5
        remote = _watch([Endpoint("http://engine", "engine")], [client])
        assert remote.own_cpu_s() == 2.5 and remote.reading().busy_jiffies is None
        here = _watch([Endpoint("http://engine", "engine", read_text=local_read)], [client])
        before = time.process_time()
        assert here.own_cpu_s() >= 2.5 + before > 2.5
    silent = httpx.Client(
        base_url="http://engine", transport=httpx.MockTransport(lambda r: httpx.Response(404))
    )
    with EngineClient("http://engine", http=silent) as client:
        assert client.engine_cpu_seconds() is None
        assert (
            _watch(
                [Endpoint("http://engine", "engine", read_text=local_read)], [client]
            ).own_cpu_s()
            is None
        )


def test_reasoning_and_answer_tokens_are_counted_apart(tmp_path):
    engine = BenchEngine(step_s=STEPS, tau=TAUS, think=5)
    result = bench(tmp_path, config_of("ar,ddtree:15", repeats=2, time_budget_s=0), engine)
    rows = {r["method"]: r for r in rows_from_cells(result.cells)}
    # "<think>w1 w2 w3 w4 </think>": the server's count of the block, per request
    block = word_count("<think>w1 w2 w3 w4 </think>")
    assert rows["ar"]["reasoning_tokens"] == 2 * block
    assert rows["ar"]["answer_tokens"] == 2 * 16 - 2 * block
    assert rows["ddtree:15"]["completion_tokens"] == 32


def test_the_agentic_turns_measure_time_to_first_token_with_the_cache_on_and_off(tmp_path):
    engine = BenchEngine(max_model_len=1024, step_s=STEPS, tau=TAUS, prefill_s=0.002)
    config = config_of(
        "ar,ddtree:15",
        scenarios=("agentic",),
        repeats=2,
        time_budget_s=0,
        agentic=AgenticShape(context=600, turns=3),
    )
    result = bench(tmp_path, config, engine)
    bodies = engine.completions
    # Per turn and method: the turn with the cache on (decoded to the length), then the same
    # prompt with it off (one token, for its time to first token).
    assert [(b.get("cache_prompt", True), b["max_tokens"]) for b in bodies[:4]] == [
        (True, 16),
        (False, 1),
        (True, 16),
        (False, 1),
    ]
    assert bodies[0]["prompt"] == bodies[1]["prompt"] != bodies[2]["prompt"]
    # Each method and repeat is its own session: no two sessions share their first turn.
    firsts = {b["prompt"] for b in bodies if b["prompt"].count("<|im_start|>") == 3}
    assert len(firsts) == 2 * 2 and all("Session " in p for p in firsts)
    rows = {r["method"]: r for r in rows_from_cells(result.cells)}
    turns = rows["ddtree:15"]["turns"]
    assert [t["turn"] for t in turns] == [0, 1, 2]
    assert turns[0]["cached_tokens"] == 0
    for before, turn in zip(turns, turns[1:], strict=False):
        assert before["prompt_tokens"] < turn["cached_tokens"] < turn["prompt_tokens"]
        assert turn["ttft_on_s"]["high"] < turn["ttft_off_s"]["low"] / 2
    # Speed counts the cache-on turns only: 3 turns x 2 repeats.
    assert rows["ar"]["requests"] == 6 and rows["ddtree:15"]["speedup"] == pytest.approx(
        2.0, rel=0.05
    )


def test_ddops_bench_validates_its_repeat_and_budget_flags():
    too_few = CliRunner().invoke(
        cli, ["bench", "--url", "http://x", "--repeats", "5", "--max-repeats", "2"]
    )
    assert too_few.exit_code == 2 and "must be >= --repeats" in too_few.output
    negative = CliRunner().invoke(cli, ["bench", "--url", "http://x", "--time-budget", "-1"])
    assert negative.exit_code == 2 and "--time-budget" in negative.output


@pytest.mark.parametrize("period_s, busy_s", [(1.3, 0.6), (2.0, 1.0)])
def test_bursts_that_outlast_the_gates_patience_never_decide_a_speedup(tmp_path, period_s, busy_s):
    """Issue 37's incident: bursts take both cores half the time, in stretches shorter than ar's
    request (64 tokens: 1.26 s quiet), so the gate cannot find a quiet moment for it, gives up
    (QUIET_PATIENCE) and measures as it is; ar's requests overlap a burst and ddtree:15's fit
    between two. The ratio was the bursts' (2.79x against 2.0x quiet, below tau 3 so the tau
    check let it through). A repeat whose requests saw other processes' load unevenly is redone
    and left out: what is reported stays within 15% of the quiet 2.0x, or is not reported."""
    clock, bursts = ScriptedClock(), Bursts(period_s=period_s, busy_s=busy_s, share=0.5)
    engine = BenchEngine(
        clock=clock,
        step_s=STEPS,
        tau=TAUS,
        prefill_s=0.0005,
        contention=lambda now: 2.0 if bursts.busy_at(now) else 1.0,  # half the cores each step
    )
    config = config_of("ar,ddtree:15", repeats=6, time_budget_s=0, lengths=(64,))
    store = RunStore.open(tmp_path / "results", {"bench": config.to_json()}, {})
    watch = ScriptedMachine(engine, others=bursts).watch()
    result = run_bench(config, engine.client(), store, NullProgress(), watch)
    assert result.machine["busy_requests"] > QUIET_PATIENCE  # the gate did give up
    assert result.machine["uneven_repeats"] >= 1
    assert "redone: other processes' load fell unevenly" in result.machine["warning"]
    tree = {r["method"]: r for r in rows_from_cells(result.cells)}["ddtree:15"]
    for figure in ("speedup", "speedup_low", "speedup_high"):
        assert tree[figure] is None or tree[figure] == pytest.approx(2.0, rel=0.15), figure
