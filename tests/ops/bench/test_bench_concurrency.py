"""The serving matrix (issue 37): N clients at once (closed loop) or Poisson arrivals (open loop),
aggregate output tok/s, requests/s, goodput under an SLO, TTFT / TPOT / ITL percentiles, per-token
ITL from incrementally parsed streams, and the report's serving table and plots. Over the scripted
engine, which decodes one request at a time as today's engine does.

    python -m pytest -q tests/ops/bench/test_bench_concurrency.py
"""

from __future__ import annotations

import csv
import io
import json
import random
import statistics

import httpx
import pytest
from click.testing import CliRunner

from ops.bench.client import EngineClient, _StreamTally, tokens_per_chunk
from ops.bench.figures import rows_from_cells, verdicts
from ops.bench.load import poisson_offsets
from ops.bench.matrix import (
    AgenticShape,
    BenchConfig,
    Method,
    Slo,
    parse_concurrency,
    parse_methods,
    parse_slo,
)
from ops.bench.report import render_report
from ops.bench.runner import NullProgress, run_bench
from ops.cli import cli
from ops.errors import DdopsError
from ops.results import RunStore
from tests.helpers.bench_engine import BenchEngine, ScriptedClock, ScriptedMachine, word_count

STEPS = {"ar": 0.020, "ddtree:15": 0.030}
TAUS = {"ar": 1.0, "ddtree:15": 3.0}


def bench(tmp_path, config: BenchConfig, engine: BenchEngine):
    store = RunStore.open(tmp_path / "results", {"bench": config.to_json()}, {})
    watch = ScriptedMachine(engine, others=0.02).watch()
    return run_bench(config, engine.client(), store, NullProgress(), watch)


def config_of(**fields) -> BenchConfig:
    base = {"lengths": (16,), "warmup": 0, "repeats": 3, "time_budget_s": 0}
    return BenchConfig(parse_methods("ar,ddtree:15"), **{**base, **fields})


def by_cell(result) -> dict[tuple[str, int], dict]:
    return {(r["method"], r["concurrency"]): r for r in rows_from_cells(result.cells)}


def test_concurrency_and_slo_options_parse_and_refuse_bad_values():
    assert parse_concurrency("8,1,4,4") == (1, 4, 8)
    assert parse_slo("ttft=2s,tpot=100ms") == Slo(ttft_s=2.0, tpot_s=0.1)
    assert parse_slo("tpot=0.5s") == Slo(tpot_s=0.5)
    for bad in ("0", "a", "", "2000"):
        with pytest.raises(DdopsError):
            parse_concurrency(bad)
    for bad in ("ttft=2", "ttft=2s,ttft=3s", "latency=1s", "ttft=0s", ""):
        with pytest.raises(DdopsError):
            parse_slo(bad)
    assert Slo(2.0, 0.1).met_by(1.5, 0.05) and not Slo(2.0, 0.1).met_by(2.5, 0.05)


@pytest.mark.parametrize(
    "option, value, said",
    [
        ("--concurrency", "0", "each level must be 1..1024"),
        ("--concurrency", "1,x", "expected whole numbers"),
        ("--slo", "ttft=fast", "expected ttft=2s,tpot=100ms"),
        ("--request-rate", "0", "--request-rate"),
        ("--requests-per-client", "0", "--requests-per-client"),
    ],
)
def test_ddops_bench_refuses_bad_serving_options_in_one_line(option, value, said):
    done = CliRunner().invoke(cli, ["bench", "--url", "http://x", option, value])
    assert done.exit_code == 2 and said in done.output
    assert "Traceback" not in done.output


def test_a_run_before_issue_37_keeps_its_config_and_cell_keys():
    """One request at a time: the config's JSON (what a resume matches) and the cells' keys are
    those of earlier runs; a concurrency level names its cells."""
    serial = config_of()
    assert "concurrency" not in serial.to_json()
    assert BenchConfig.from_json(serial.to_json()) == serial
    served = config_of(concurrency=(1, 4), slo=Slo(ttft_s=2.0))
    assert BenchConfig.from_json(json.loads(json.dumps(served.to_json()))) == served
    assert [c.key for c in served.cells()] == [
        "decode-16-ar",
        "decode-16-ddtree-15",
        "decode-16-c4-ar",
        "decode-16-c4-ddtree-15",
    ]


def test_four_clients_on_a_one_at_a_time_engine_queue_and_gain_nothing(tmp_path):
    """Done-when of issue 37 on the scripted engine: at c=4 the aggregate output tok/s is c=1's
    (the engine decodes one request at a time), and the queue shows in TTFT: a request waits
    for up to three others."""
    engine = BenchEngine(step_s=STEPS, tau=TAUS)
    config = config_of(concurrency=(1, 4), requests_per_client=2, slo=Slo(ttft_s=0.2))
    result = bench(tmp_path, config, engine)
    assert engine.peak_in_flight == 4
    rows = by_cell(result)
    for method in ("ar", "ddtree:15"):
        one, four = rows[(method, 1)], rows[(method, 4)]
        assert four["output_tok_s"] == pytest.approx(one["output_tok_s"], rel=0.05)
        assert four["requests_per_s"] == pytest.approx(one["requests_per_s"], rel=0.05)
        assert four["requests"] == 3 * 8 and one["requests"] == 3 * 2
        # Closed loop on a serial engine: once the first four are queued, every request waits
        # for the three ahead of it (3 whole requests), then its own prefill.
        request_s, prefill_s = 1 / one["requests_per_s"], one["ttft_p50_s"]
        assert four["ttft_p99_s"] == pytest.approx(3 * request_s + prefill_s, rel=0.02)
        assert four["ttft_p50_s"] > 5 * one["ttft_p50_s"]
        assert one["goodput_rps"] == pytest.approx(one["requests_per_s"])
        assert four["goodput_rps"] < four["requests_per_s"] / 2
        assert four["itl_p99_s"] == pytest.approx(STEPS[method])  # decoding itself is as fast
    # Only the first of ar's 8 requests a window starts within the SLO's 200 ms.
    assert rows[("ar", 4)]["goodput_rps"] == pytest.approx(rows[("ar", 4)]["requests_per_s"] / 8)
    # At c=4 the speedup compares output tok/s; ddtree:15's windows are faster, paired by repeat.
    (one, four) = verdicts(rows_from_cells(result.cells))
    assert (one["column"], four["column"]) == ("decode 16", "decode 16 c4")
    assert four["winner"] == "ddtree:15"


def test_an_open_loop_sends_at_seeded_poisson_arrivals_the_same_for_every_method(tmp_path):
    offsets = poisson_offsets(2000, rate=4.0, seed=3)
    assert offsets[0] == 0.0 and offsets == poisson_offsets(2000, rate=4.0, seed=3)
    assert statistics.mean(b - a for a, b in zip(offsets, offsets[1:], strict=False)) == (
        pytest.approx(0.25, rel=0.08)
    )
    rng = random.Random(3)  # the gaps are the seed's expovariate draws, as guidellm's poisson
    gaps = [b - a for a, b in zip(offsets, offsets[1:], strict=False)]
    assert gaps == pytest.approx([rng.expovariate(4.0) for _ in gaps], abs=1e-9)
    engine = BenchEngine(step_s=STEPS, tau=TAUS)
    config = config_of(
        concurrency=(2,), requests_per_client=3, request_rate=2.0, repeats=2, seed=11
    )
    result = bench(tmp_path, config, engine)
    for cell in result.cells:
        for repeat in (0, 1):
            starts = [s["start_s"] for s in cell["samples"] if s["repeat"] == repeat]
            arrivals = poisson_offsets(6, 2.0, config.seed + repeat)
            assert len(starts) == 6
            assert all(start >= at - 1e-9 for start, at in zip(starts, arrivals, strict=True))
    assert engine.peak_in_flight <= 2


def test_itl_is_each_tokens_arrival_not_each_chunks():
    clock = ScriptedClock()
    tally = _StreamTally(clock)
    for text, gap in (("a", 0.0), ("b c d", 0.06), ("e", 0.02)):
        clock.advance(gap)
        tally.take({"choices": [{"text": text}]}, "engine")
    tally.take({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 5}}, "engine")
    sample = tally.completion(clock.now - 0.09, clock.now, "engine").sample
    assert sample.itl_s == [0.06, 0.0, 0.0, 0.02]  # "b c d" is three tokens arriving together
    assert tokens_per_chunk([1, 5, 1], 5) == [1, 3, 1]
    assert sum(tokens_per_chunk([3, 7, 2, 9], 50)) == 50


class SlowConnections(httpx.AsyncBaseTransport):
    """The scripted engine behind connections that take `connect_s` to open, told through
    httpcore's trace events as a real connection tells them."""

    def __init__(self, engine: BenchEngine, connect_s: float) -> None:
        self.inner, self.clock, self.connect_s = (
            httpx.MockTransport(engine),
            engine.clock,
            connect_s,
        )

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        trace = request.extensions["trace"]
        await trace("connection.connect_tcp.started", {})
        self.clock.advance(self.connect_s)
        await trace("connection.connect_tcp.complete", {})
        await trace("http11.send_request_headers.started", {"request": request})
        await trace("http11.send_request_headers.started", {"request": request})  # said once
        return await self.inner.handle_async_request(request)


def test_ttft_starts_when_the_request_is_written_not_when_its_connection_opens():
    """guidellm's start: the first header written; a slow connect (50 ms here) is the client's
    side, not the server's time to first token. A transport that says nothing (no trace
    events) is timed from the call."""
    prompt, ar = "one two three four five", Method("ar")
    prefill = 0.002 * word_count(prompt)
    engine = BenchEngine(step_s=STEPS, tau=TAUS, prefill_s=0.002)
    slow = SlowConnections(engine, connect_s=0.050)
    client = EngineClient("http://engine", stream_transport=slow, clock=engine.clock)
    sample = client.complete(prompt, max_tokens=4, method=ar).sample
    assert sample.ttft_s == pytest.approx(prefill)  # the prefill alone, not the connect
    assert sample.e2e_s == pytest.approx(prefill + 3 * STEPS["ar"])
    plain = BenchEngine(step_s=STEPS, tau=TAUS, prefill_s=0.002).client()
    assert plain.complete(prompt, max_tokens=4, method=ar).sample.ttft_s == pytest.approx(prefill)


def test_the_report_has_the_serving_table_csv_and_plots(tmp_path):
    engine = BenchEngine(step_s=STEPS, tau=TAUS)
    result = bench(tmp_path, config_of(concurrency=(1, 2), slo=Slo(tpot_s=0.1)), engine)
    files = render_report(result.run_dir)
    text = files.markdown.read_text()
    assert "## Serving: throughput and latency" in text
    assert "| ddtree:15 | decode 16 c2 |" in text and "| decode 16 c2 |" in text.splitlines()[4]
    assert {p.name for p in files.plots} >= {
        "throughput_by_concurrency.png",
        "latency_by_throughput.png",
    }
    header = files.csv.read_text().splitlines()[0].split(",")
    for name in ("concurrency", "output_tok_s_low", "goodput_rps", "itl_p99_s", "ttft_p90_s"):
        assert name in header
    shown = CliRunner().invoke(cli, ["bench", "report", str(result.run_dir)])
    assert shown.exit_code == 0 and "decode 16 c2" in shown.output


# -- servers side by side ------------------------------------------------------------------------
def test_two_servers_run_interleaved_in_one_report_with_a_verdict_between_them(tmp_path):
    clock, sent = ScriptedClock(), []

    def engine(name: str, ar_step: float) -> BenchEngine:
        def log(n: int, body: dict) -> float:
            sent.append(f"{body['speculative']['method']}@{name}")
            return 1.0

        steps = {**STEPS, "ar": ar_step}
        return BenchEngine(clock=clock, step_s=steps, tau=TAUS, slowdown=log)

    first, second = engine("s1", 0.020), engine("s2", 0.015)  # s2's ar is 4/3 as fast
    config = config_of(servers=2, concurrency=(1, 2))
    store = RunStore.open(tmp_path / "results", {"bench": config.to_json()}, {})
    store.manifest["versions"] = {
        "servers": [{"url": "http://a", "model": "m"}, {"url": "http://b", "model": "m"}]
    }
    watch = ScriptedMachine(first, others=0.02).watch()
    result = run_bench(config, [first.client(), second.client()], store, NullProgress(), watch)
    # One repeat at c=1: every method on every server, back to back, rotated.
    assert sent[:8] == [
        *("ar@s1", "ar@s2", "ddtree@s1", "ddtree@s2"),
        *("ar@s2", "ddtree@s1", "ddtree@s2", "ar@s1"),
    ]
    rows = {(r["label"], r["concurrency"]): r for r in rows_from_cells(result.cells)}
    assert set(rows) == {(m, c) for m in ("ar @s1", "ar @s2", "ddtree:15 @s1", "ddtree:15 @s2")
                         for c in (1, 2)}  # fmt: skip
    assert rows[("ar @s2", 1)]["vs_first"] == pytest.approx(4 / 3, rel=0.01)
    assert rows[("ddtree:15 @s2", 1)]["vs_first"] == pytest.approx(1.0, rel=0.01)
    # Each server's speedups are over its own ar.
    assert rows[("ddtree:15 @s1", 1)]["speedup"] == pytest.approx(2.0, rel=0.01)
    assert rows[("ddtree:15 @s2", 1)]["speedup"] == pytest.approx(1.5, rel=0.01)
    files = render_report(result.run_dir)
    text = files.markdown.read_text()
    assert "## Servers side by side" in text
    assert "- s2: http://b: model m, answered ar, ddtree:15" in text
    assert "- decode 16, ar: s2 wins: 1.33x over s1, clear of the rest" in text
    assert "- decode 16, ddtree:15: no clear winner at this noise" in text
    document = json.loads(files.json.read_text())
    assert [v["method"] for v in document["server_verdicts"]] == ["ar", "ddtree:15"] * 2


def test_ttft_gets_its_own_verdict_between_servers_in_every_report_format(tmp_path):
    """s2 prefills 4x slower and decodes as fast: decode tok/s has no winner between them,
    TTFT p50 does (s1, the lower), paired by repeat; the markdown, CSV, JSON and `bench
    report` all carry it."""
    clock = ScriptedClock()
    first, second = (BenchEngine(clock=clock, step_s=STEPS, tau=TAUS, prefill_s=p)
                     for p in (0.001, 0.004))  # fmt: skip
    config = config_of(servers=2)
    store = RunStore.open(tmp_path / "results", {"bench": config.to_json()}, {})
    store.manifest["versions"] = {
        "servers": [{"url": "http://a", "model": "m"}, {"url": "http://b", "model": "m"}]
    }
    watch = ScriptedMachine(first, others=0.02).watch()
    result = run_bench(config, [first.client(), second.client()], store, NullProgress(), watch)
    rows = {r["label"]: r for r in rows_from_cells(result.cells)}
    ttft = {label: statistics.median(s["ttft_s"] for s in cell["samples"])
            for label, cell in zip(("s2", "s1"), result.cells[:2], strict=True)}  # fmt: skip
    assert rows["ar @s2"]["ttft_vs_first"] == pytest.approx(ttft["s2"] / ttft["s1"])
    assert rows["ar @s2"]["ttft_vs_first"] > 2 and rows["ar @s2"]["vs_first"] == 1.0
    assert rows["ar @s1"]["ttft_vs_first"] is None  # the first server is the baseline
    files = render_report(result.run_dir)
    text = files.markdown.read_text()
    assert "- decode 16, ar: no clear winner at this noise" in text
    assert "- decode 16, ar, TTFT p50: s1 wins: every other is clearly higher" in text
    assert "| ar @s2 | decode 16 | 1.00x | " in text  # the ratios' table: tok/s, TTFT p50
    found = json.loads(files.json.read_text())["server_verdicts"]
    assert [(v["method"], v["winner"], v["ttft_p50"]["winner"]) for v in found] == [
        ("ar", None, "s1"),
        ("ddtree:15", None, "s1"),
    ]
    table = list(csv.DictReader(io.StringIO(files.csv.read_text())))
    second_ar = next(r for r in table if r["method"] == "ar" and r["server"] == "1")
    assert float(second_ar["ttft_vs_first_low"]) > 2 and second_ar["vs_first"] == "1.0"
    shown = CliRunner().invoke(cli, ["bench", "report", str(result.run_dir)])
    assert shown.exit_code == 0 and "ar, TTFT p50: s1 wins" in shown.output


def test_ddops_bench_takes_each_url_once():
    twice = CliRunner().invoke(cli, ["bench", "--url", "http://x", "--url", "http://x"])
    assert twice.exit_code == 2 and "each server once" in twice.output
    gone = ["--url", "http://127.0.0.1:9", "--url", "http://127.0.0.1:10"]
    down = CliRunner().invoke(cli, ["bench", *gone])
    assert down.exit_code == 1 and "not ready" in down.output


def test_the_servers_default_method_sends_no_speculative_field(tmp_path):
    engine = BenchEngine(step_s=STEPS, tau=TAUS)
    config = BenchConfig(parse_methods("default,ar"), lengths=(16,), repeats=1, warmup=0,
                         time_budget_s=0)  # fmt: skip
    result = bench(tmp_path, config, engine)
    assert [b.get("speculative") for b in engine.completions] == [{"method": "ar"}, None]
    rows = rows_from_cells(result.cells)
    assert [r["method"] for r in rows] == ["ar", "default"]
    served = {s["served"] for c in result.cells for s in c["samples"]}
    assert served == {"ar", "ddtree:15"}  # what the scripted server decodes by default


# -- the agentic scenario at concurrency ----------------------------------------------------------
def test_agents_at_once_each_grow_their_own_conversation_with_the_cache_on_and_off(tmp_path):
    """Must 2: at concurrency 3, three agents a method and repeat, each its own session; each
    turn is a window of the three with the cache on, then of the three re-sent with it off.
    A later turn reuses its own agent's earlier turn, never another's."""
    engine = BenchEngine(max_model_len=1024, step_s=STEPS, tau=TAUS, prefill_s=0.002)
    config = config_of(scenarios=("agentic",), concurrency=(3,), repeats=1)
    config = BenchConfig(**{**config.__dict__, "agentic": AgenticShape(context=600, turns=3)})
    result = bench(tmp_path, config, engine)
    assert engine.peak_in_flight == 3
    bodies = engine.completions
    # ar's turn 0: three agents cached (16 tokens), then the same three re-sent cache off.
    assert [(b.get("cache_prompt", True), b["max_tokens"]) for b in bodies[:6]] == [
        *[(True, 16)] * 3,
        *[(False, 1)] * 3,
    ]
    firsts = [b["prompt"] for b in bodies[:3]]
    assert len(set(firsts)) == 3 and all("Session " in p for p in firsts)
    rows = {r["method"]: r for r in rows_from_cells(result.cells)}
    turns = rows["ddtree:15"]["turns"]
    assert [t["turn"] for t in turns] == [0, 1, 2]
    for before, turn in zip(turns, turns[1:], strict=False):
        assert before["prompt_tokens"] < turn["cached_tokens"] < turn["prompt_tokens"]
    # Three prefills queue on a one-at-a-time engine: the p99 waits for the two ahead of it.
    assert turns[2]["ttft_off_p99_s"] > 2 * turns[2]["ttft_off_s"]["low"]
    text = render_report(result.run_dir).markdown.read_text()
    assert "| agents | turn |" in text and "p99 on / off ms" in text


def test_one_client_sends_its_requests_one_after_another(tmp_path):
    engine = BenchEngine(step_s=STEPS, tau=TAUS)
    result = bench(tmp_path, config_of(requests_per_client=3, repeats=1), engine)
    cell = next(c for c in result.cells if c["cell"]["method"] == "ar")
    starts = [s["start_s"] for s in cell["samples"]]
    ends = [s["start_s"] + s["e2e_s"] for s in cell["samples"]]
    assert len(starts) == 3 and engine.peak_in_flight == 1
    assert all(b >= a - 1e-9 for a, b in zip(ends, starts[1:], strict=False))  # closed loop
