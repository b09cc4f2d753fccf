"""The bench without an engine: matrix parsing, the crash-safe run store, prompt fitting, cell
summaries, the stream parser of the client, and the report rendered from stored results
(golden markdown in tests/data/bench/). Fast: no server, no torch.

    python -m pytest -q tests/ops/bench/test_bench_offline.py
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from ops.bench.client import EngineClient, Sample
from ops.bench.figures import percentile, summarize
from ops.bench.matrix import (
    AgenticShape,
    BenchConfig,
    Cell,
    Method,
    parse_lengths,
    parse_methods,
    parse_scenarios,
)
from ops.bench.prompts import (
    AgenticTranscript,
    filler_text,
    fit_to_tokens,
    long_prompt,
)
from ops.bench.report import csv_text, load_rows, render_report
from ops.bench.runner import NullProgress, run_bench
from ops.cli import cli
from ops.errors import DdopsError
from ops.results import (
    COMPLETE,
    CRASHED,
    MANIFEST,
    RUNNING,
    RunStore,
    find_stale_runs,
    quarantine_run,
    read_json,
)
from tests.helpers import DATA as HELPERS_DATA
from tests.helpers.bench_engine import BenchEngine, sse, word_count

DATA = HELPERS_DATA / "bench"
# A run stored before issue 31 (its cells' metrics, no samples): it still renders, without spreads.
GOLDEN_RUN = DATA / "run-before-issue31"
GOLDEN_MARKDOWN = DATA / "report-before-issue31.md"


# -- matrix ------------------------------------------------------------------------------------
def test_methods_parse_with_budgets_and_keep_their_order():
    assert parse_methods("ddtree:15, ar,linear,ddtree:15") == (
        Method("ddtree", 15),
        Method("ar"),
        Method("linear"),
    )
    assert Method("ddtree", 15).speculative() == {"method": "ddtree", "budget": 15}
    assert Method("linear").speculative() == {"method": "linear"}


@pytest.mark.parametrize("text", ["tree", "ar:3", "ddtree:0", "ddtree:x", ""])
def test_bad_methods_are_refused(text):
    with pytest.raises(DdopsError):
        parse_methods(text)


def test_lengths_and_scenarios_are_validated():
    assert parse_lengths("256,1024,256") == (256, 1024)
    assert parse_scenarios("long,agentic") == ("long", "agentic")
    for bad in ("1", "a,b", ""):
        with pytest.raises(DdopsError):
            parse_lengths(bad)
    with pytest.raises(DdopsError):
        parse_scenarios("decode,chat")


def test_cells_put_ar_first_in_each_column_and_have_file_safe_keys():
    config = BenchConfig(
        methods=parse_methods("ddtree:15,ar"), lengths=(16, 32), scenarios=("decode", "long")
    )
    assert [(c.scenario, c.length, c.method.label) for c in config.cells()] == [
        ("decode", 16, "ar"),
        ("decode", 16, "ddtree:15"),
        ("decode", 32, "ar"),
        ("decode", 32, "ddtree:15"),
        ("long", 16, "ar"),
        ("long", 16, "ddtree:15"),
        ("long", 32, "ar"),
        ("long", 32, "ddtree:15"),
    ]
    assert Cell("long", 32, Method("ddtree", 15)).key == "long-32-ddtree-15"


def test_config_round_trips_through_json():
    config = BenchConfig(
        parse_methods("ar,ddtree:4"), (16,), ("agentic",), 2, 0, AgenticShape(64, 2)
    )
    assert BenchConfig.from_json(json.loads(json.dumps(config.to_json()))) == config


# -- store ---------------------------------------------------------------------------------------
def dead_pid() -> int:
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


CONFIG = {"target": "test", "bench": {"lengths": [16]}}


def test_a_run_has_a_manifest_and_atomic_cells(tmp_path):
    store = RunStore.open(tmp_path, CONFIG, {"ddops": "x"})
    manifest = read_json(store.run_dir / MANIFEST)
    assert manifest["state"] == RUNNING
    assert manifest["host"] == socket.gethostname()
    assert manifest["config"] == CONFIG and manifest["versions"] == {"ddops": "x"}
    assert isinstance(manifest["pid"], int) and manifest["finished"] is None
    store.record_sample("decode-16-ar", {"ttft_s": 0.1})
    assert not store.has_cell("decode-16-ar")
    store.write_cell("decode-16-ar", {"cell": {"key": "decode-16-ar"}})
    assert store.has_cell("decode-16-ar")
    # The cell's samples file is gone once the cell is stored; no temp file is left behind.
    assert {p.name for p in store.run_dir.iterdir()} == {MANIFEST, "cell-decode-16-ar.json"}
    store.finish()
    assert read_json(store.run_dir / MANIFEST)["state"] == COMPLETE
    # A complete run is not resumed: the same config starts a new run.
    assert RunStore.open(tmp_path, CONFIG, {}).run_dir != store.run_dir


def make_stale_run(results: Path) -> RunStore:
    store = RunStore.open(results, CONFIG, {})
    store.write_cell("decode-16-ar", {"cell": {"key": "decode-16-ar"}})
    store.record_sample("decode-16-linear", {"ttft_s": 0.2})
    (store.run_dir / ".cell-decode-16-linear.json.123.tmp").write_text('{"cut')
    store.manifest["pid"] = dead_pid()
    store._save()
    return store


def test_a_dead_running_run_is_found_and_quarantined_without_deleting(tmp_path):
    store = make_stale_run(tmp_path)
    live = RunStore.open(tmp_path / "other", CONFIG, {})  # this process: alive
    assert find_stale_runs(tmp_path) == [store.run_dir]
    assert find_stale_runs(tmp_path / "other") == []
    assert find_stale_runs(tmp_path / "missing") == []

    aside = quarantine_run(store.run_dir)

    assert aside.parent == store.run_dir and re.fullmatch(r"crashed-\d{8}T\d{6}Z", aside.name)
    assert {p.name for p in aside.iterdir()} == {
        "cell-decode-16-linear.partial.jsonl",
        ".cell-decode-16-linear.json.123.tmp",
    }
    assert store.has_cell("decode-16-ar")
    manifest = read_json(store.run_dir / MANIFEST)
    assert manifest["state"] == CRASHED
    assert manifest["crashes"][0]["moved_to"] == aside.name
    assert find_stale_runs(tmp_path) == []
    assert live.run_dir.exists()


def test_reopening_quarantines_a_stale_run_and_resumes_it(tmp_path):
    stale = make_stale_run(tmp_path)
    resumed = RunStore.open(tmp_path, CONFIG, {"ddops": "y"})
    assert resumed.run_dir == stale.run_dir and resumed.resumed
    manifest = read_json(resumed.run_dir / MANIFEST)
    assert manifest["state"] == RUNNING and len(manifest["attempts"]) == 2
    assert manifest["crashes"][0]["reason"] == "its process is gone"
    assert resumed.has_cell("decode-16-ar") and not resumed.has_cell("decode-16-linear")
    assert len(list(resumed.run_dir.glob("crashed-*/*.partial.jsonl"))) == 1


def test_a_live_run_of_the_same_config_is_not_taken_over(tmp_path):
    RunStore.open(tmp_path, CONFIG, {})
    with pytest.raises(DdopsError, match="in progress"):
        RunStore.open(tmp_path, CONFIG, {})
    assert RunStore.open(tmp_path, {**CONFIG, "target": "other"}, {}).run_dir.exists()


def test_a_failing_run_marks_itself_crashed(tmp_path):
    store = RunStore.open(tmp_path, CONFIG, {})
    store.record_sample("decode-16-ar", {"ttft_s": 0.1})
    aside = store.fail("DdopsError: engine gone")
    assert store.manifest["state"] == CRASHED
    assert store.manifest["crashes"][-1]["reason"] == "DdopsError: engine gone"
    assert (aside / "cell-decode-16-ar.partial.jsonl").exists()


# -- prompts -------------------------------------------------------------------------------------
def paren_heavy_count(text: str) -> int:
    """One token per character, two for '(' : the filler's next character can overshoot."""
    return len(text) + text.count("(")


@pytest.mark.parametrize("target", [40, 123, 700])
def test_fitting_lands_on_the_exact_count(target):
    fitted = fit_to_tokens(word_count, "Read this.\n\n", target)
    assert fitted.exact and word_count(fitted.prompt) == target
    assert fitted.prompt.startswith("Read this.\n\n")


def test_fitting_touches_up_where_one_character_adds_two_tokens():
    head = "H: "
    filler = filler_text(4000)
    gap = filler.index("(")
    target = paren_heavy_count(head + filler[:gap]) + 1  # "(" would overshoot it by one
    fitted = fit_to_tokens(paren_heavy_count, head, target)
    assert paren_heavy_count(fitted.prompt) == target and fitted.exact


def test_fitting_keeps_a_tail_at_the_end():
    fitted = fit_to_tokens(word_count, "head ", 90, tail=" END")
    assert fitted.prompt.endswith(" END") and word_count(fitted.prompt) == 90


def test_a_long_prompt_fills_the_context_minus_max_tokens():
    fitted = long_prompt(word_count, max_model_len=1000, max_tokens=64)
    assert word_count(fitted.prompt) + 64 == 1000 and fitted.skipped is None


def test_a_long_prompt_that_cannot_fit_is_skipped_with_the_numbers():
    fitted = long_prompt(word_count, max_model_len=100, max_tokens=95)
    assert fitted.skipped is not None
    assert re.search(
        r"at least \d+ tokens; with max_tokens 95 that is \d+ > max-model-len 100", fitted.skipped
    )
    assert long_prompt(word_count, max_model_len=100, max_tokens=100).skipped


def test_the_agentic_transcript_grows_evenly_to_the_context():
    transcript = AgenticTranscript(word_count, AgenticShape(context=2000, turns=3), 20, 4096)
    assert transcript.skipped is None
    first = transcript.prompt_for_turn(0)
    second = transcript.prompt_for_turn(1, "the answer")
    third = transcript.prompt_for_turn(2, "another answer")
    assert first.tokens == transcript.head_tokens
    assert second.prompt.startswith(first.prompt + "the answer\n<tool_call>")
    assert "<tool_response>" in second.prompt and third.prompt.startswith(second.prompt)
    assert [p.tokens for p in (second, third)] == [
        transcript.turn_target(1),
        2000 - 20,
    ]


def test_the_agentic_context_is_capped_by_max_model_len():
    transcript = AgenticTranscript(word_count, AgenticShape(context=4096, turns=2), 16, 300)
    assert transcript.turn_target(1) == 300 - 16
    tiny = AgenticTranscript(word_count, AgenticShape(context=30, turns=2), 16, 300)
    assert "30-token context" in tiny.skipped


# -- summaries -----------------------------------------------------------------------------------
def sample(tokens: int, decode_s: float, rounds: int = 0, tau: float = 0.0) -> Sample:
    return Sample(
        prompt_tokens=10,
        completion_tokens=tokens,
        ttft_s=0.5,
        decode_s=decode_s,
        e2e_s=0.5 + decode_s,
        rounds=rounds,
        tau=tau,
    )


def test_percentiles_interpolate():
    assert percentile([4.0, 1.0, 2.0, 3.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 90) == pytest.approx(4.6)
    assert percentile([], 50) is None


def test_a_cell_summary_weights_rates_by_tokens_and_tau_by_rounds():
    figures = summarize([sample(11, 1.0, rounds=2, tau=5.0), sample(31, 2.0, rounds=10, tau=3.0)])
    assert figures["decode_tok_s"] == pytest.approx((10 + 30) / 3.0)
    assert figures["e2e_tok_s"] == pytest.approx(42 / 4.0)
    assert figures["tau"] == pytest.approx((2 * 5 + 10 * 3) / 12)
    assert figures["rounds"] == 6
    assert figures["tpot_p50_s"] == pytest.approx((0.1 + 1 / 15) / 2)
    assert summarize([sample(1, 0.0)])["decode_tok_s"] is None


# -- the client's stream parser ------------------------------------------------------------------
def client_answering(body: bytes, status: int = 200) -> EngineClient:
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return httpx.Response(status, content=body)

    transport = httpx.MockTransport(handler)
    http = httpx.Client(base_url="http://engine", transport=transport)
    client = EngineClient("http://engine", http=http, stream_transport=transport)
    client.seen = seen
    return client


def test_a_streamed_completion_gives_text_counts_and_speculative_stats():
    choice = {"index": 0, "text": "ab", "finish_reason": None}
    client = client_answering(
        sse(
            {"choices": [choice]},
            {"choices": [{**choice, "text": "cd"}]},
            {
                "choices": [{**choice, "text": "", "finish_reason": "length"}],
                "speculative": {"method": "ddtree", "rounds": 3, "mean_acceptance_length": 4.5},
            },
            {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 12}},
        )
    )
    done = client.complete("p", max_tokens=12, method=Method("ddtree", 15))
    assert done.text == "abcd" and done.finish_reason == "length"
    assert (done.sample.prompt_tokens, done.sample.completion_tokens) == (7, 12)
    assert (done.sample.rounds, done.sample.tau) == (3, 4.5)
    assert 0 <= done.sample.ttft_s <= done.sample.e2e_s
    request = client.seen[0]
    assert request["stream"] and request["stream_options"] == {"include_usage": True}
    assert request["speculative"] == {"method": "ddtree", "budget": 15}


def test_engine_refusals_and_stream_errors_name_the_engine():
    refused = client_answering(b'{"error": {"message": "prompt too long"}}', status=400)
    with pytest.raises(DdopsError, match="engine at http://engine: .*400: prompt too long"):
        refused.complete("p", max_tokens=4, method=Method("ar"))
    broken = client_answering(sse({"error": {"message": "worker died"}}))
    with pytest.raises(DdopsError, match="worker died"):
        broken.complete("p", max_tokens=4, method=Method("ar"))


# -- report --------------------------------------------------------------------------------------
def test_the_report_renders_the_golden_markdown_from_stored_results(tmp_path):
    run = shutil.copytree(GOLDEN_RUN, tmp_path / GOLDEN_RUN.name)
    files = render_report(run)
    assert files.markdown.read_text() == GOLDEN_MARKDOWN.read_text()
    rows = json.loads(files.json.read_text())["rows"]
    assert len(rows) == 16 and json.loads(files.json.read_text())["run"]["state"] == "complete"
    assert {p.name for p in files.plots} == {
        "speedup_by_method_length.png",
        "tau_tok_s_by_budget.png",
    }
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in files.plots)


def test_speedup_is_against_ar_of_the_same_cell_and_csv_has_every_row():
    rows = load_rows(GOLDEN_RUN)
    by = {(r["method"], r["scenario"], r["length"]): r for r in rows}
    assert by[("ddtree:15", "decode", 1024)]["speedup"] == pytest.approx(173.4 / 26.1)
    assert by[("linear", "long", 256)]["speedup"] == pytest.approx(70.3 / 21.0)
    assert by[("ar", "long", 32768)]["speedup"] is None
    lines = csv_text(rows).splitlines()
    assert lines[0].startswith(
        "method,scenario,length,concurrency,server,decode_tok_s,decode_tok_s_low"
    )
    assert len(lines) == 17 and "ddtree:15,decode,256,1,0,123.9,123.9,123.9," in lines[4]


def test_ddops_bench_report_re_renders_a_stored_run(tmp_path):
    run = shutil.copytree(GOLDEN_RUN, tmp_path / GOLDEN_RUN.name)
    shown = CliRunner().invoke(cli, ["bench", "report", str(run)])
    assert shown.exit_code == 0, shown.output
    assert shown.output == GOLDEN_MARKDOWN.read_text() + "\n"
    as_json = CliRunner().invoke(cli, ["--json", "bench", "report", str(run)])
    document = json.loads(as_json.output)
    assert document["files"]["markdown"] == str(run / "report.md")
    assert document["rows"] == load_rows(run)
    assert document["verdicts"][0]["text"].startswith("no clear winner at this noise (only 1 clean")


def test_ddops_bench_needs_one_engine_and_valid_options():
    neither = CliRunner().invoke(cli, ["bench"])
    assert neither.exit_code == 2 and "--ct VMID" in neither.output
    bad = CliRunner().invoke(cli, ["bench", "--url", "http://x", "--methods", "tree"])
    assert bad.exit_code == 2 and "expected ar, linear, ddtree" in bad.output
    gone = CliRunner().invoke(cli, ["bench", "--url", "http://127.0.0.1:9", "--lengths", "16"])
    assert gone.exit_code == 1 and "not ready" in gone.output


# -- run_bench over a scripted engine ------------------------------------------------------------
def test_run_bench_measures_each_cell_after_warm_up_and_skips_what_cannot_fit(tmp_path):
    engine = BenchEngine(max_model_len=256)
    config = BenchConfig(
        parse_methods("ar,ddtree:4"), lengths=(16, 256), repeats=2, warmup=1, time_budget_s=0
    )
    store = RunStore.open(tmp_path, {"bench": config.to_json()}, {})
    result = run_bench(config, engine.client(), store, NullProgress())
    by_key = {c["cell"]["key"]: c for c in result.cells}
    assert set(by_key) == {
        "decode-16-ar",
        "decode-16-ddtree-4",
        "decode-256-ar",
        "decode-256-ddtree-4",
    }
    measured = by_key["decode-16-ddtree-4"]
    assert measured["metrics"]["requests"] == 2 and measured["metrics"]["tau"] == 2.0
    assert [s["repeat"] for s in measured["samples"]] == [0, 1]
    assert "> max-model-len 256" in by_key["decode-256-ar"]["skipped"]
    # Each method warms up (8 tokens), then the repeats alternate the methods, rotated; the
    # decode prompt goes with the prefix cache off. The skipped length sends nothing.
    sent = [(b["speculative"]["method"], b["max_tokens"]) for b in engine.completions]
    assert sent == [
        ("ar", 8),
        ("ddtree", 8),
        ("ar", 16),
        ("ddtree", 16),
        ("ddtree", 16),
        ("ar", 16),
    ]
    assert all(b["cache_prompt"] is False for b in engine.completions)
    assert read_json(result.run_dir / MANIFEST)["state"] == COMPLETE


def test_a_run_that_fails_midway_is_marked_crashed_and_the_rerun_resumes(tmp_path):
    config = BenchConfig(
        parse_methods("ar,linear"), lengths=(16, 32), repeats=2, warmup=0, time_budget_s=0
    )
    run_config = {"bench": config.to_json()}
    store = RunStore.open(tmp_path, run_config, {})
    with pytest.raises(DdopsError, match="500: engine fell over"):
        run_bench(config, BenchEngine(fail_at=6).client(), store, NullProgress())
    manifest = read_json(store.run_dir / MANIFEST)
    assert manifest["state"] == CRASHED and "engine fell over" in manifest["crashes"][0]["reason"]
    # The first length's group is stored whole; the second's first repeat was kept aside.
    assert store.has_cell("decode-16-ar") and store.has_cell("decode-16-linear")
    assert not store.has_cell("decode-32-ar") and not store.has_cell("decode-32-linear")
    aside = store.run_dir / manifest["crashes"][0]["moved_to"]
    assert (aside / "cell-decode-32-ar.partial.jsonl").read_text().count("\n") == 1

    engine = BenchEngine()
    resumed = RunStore.open(tmp_path, run_config, {})
    result = run_bench(config, engine.client(), resumed, NullProgress())
    assert result.resumed and result.run_dir == store.run_dir
    assert [b["max_tokens"] for b in engine.completions] == [32] * 4
    assert len(result.cells) == 4
