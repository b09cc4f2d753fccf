"""The bench against a real `python -m engine serve` (tiny random Qwen3 + DFlash drafter, byte
tokenizer, max-model-len 512): the long prompt fits to the exact token by the server's count,
and `ddops bench` killed with SIGKILL mid-run is detected, moved aside and resumed by the next
run (a real subprocess each time, --json output). The agentic scenario runs over the demo pair
in tests/ops/bench/test_agentic.py: its tools block alone outgrows this byte tokenizer's 512 tokens.

Marked slow: the server process imports torch (a minute on a loaded machine); CI runs it.

    python -m pytest -q --slow tests/integration/test_bench_against_engine.py
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ops.bench.client import EngineClient
from ops.bench.matrix import BenchConfig, Method, parse_methods
from ops.bench.prompts import long_prompt
from ops.bench.runner import NullProgress, run_bench
from ops.errors import DdopsError
from ops.results import MANIFEST, RUNNING, RunStore, find_stale_runs, read_json
from tests.helpers.engine_server import start_engine_server
from tests.helpers.tiny_qwen3 import save_tiny_dflash, save_tiny_qwen3
from tests.helpers.tiny_tokenizer import BYTE_VOCAB_SIZE, save_byte_tokenizer

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 512
KILL_WAIT_S = 120.0


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench-models")
    target = save_tiny_qwen3(root / "tiny", vocab_size=BYTE_VOCAB_SIZE, tokenizer=False)
    save_byte_tokenizer(target)
    draft = save_tiny_dflash(root / "tiny-draft", target)
    extra = ["--max-model-len", str(MAX_MODEL_LEN), "--budget", "4"]
    instance = start_engine_server(target, draft, extra_args=extra)
    yield instance
    instance.stop()


@pytest.fixture
def client(server):
    with EngineClient(server.url) as session:
        yield session


def bench(client, results: Path, **config) -> tuple[RunStore, list[dict]]:
    config = BenchConfig(**{"warmup": 0, "time_budget_s": 0, **config})
    store = RunStore.open(results, {"bench": config.to_json()}, {})
    result = run_bench(config, client, store, NullProgress())
    return store, result.cells


def test_the_long_prompt_fits_max_model_len_to_the_exact_token(client):
    assert client.max_model_len() == MAX_MODEL_LEN
    fitted = long_prompt(client.count_tokens, max_model_len=MAX_MODEL_LEN, max_tokens=32)
    assert client.count_tokens(fitted.prompt) + 32 == MAX_MODEL_LEN
    done = client.complete(fitted.prompt, max_tokens=32, method=Method("ar"))
    assert done.sample.prompt_tokens == MAX_MODEL_LEN - 32
    with pytest.raises(DdopsError, match="400: prompt and max_tokens exceed the context limit"):
        client.complete(fitted.prompt, max_tokens=33, method=Method("ar"))


def test_the_long_scenario_measures_what_fits_and_skips_what_cannot(client, tmp_path):
    _, cells = bench(
        client,
        tmp_path,
        methods=parse_methods("ar,ddtree:4"),
        lengths=(16, 512),
        scenarios=("long",),
    )
    by_key = {c["cell"]["key"]: c for c in cells}
    for key in ("long-16-ar", "long-16-ddtree-4"):
        assert by_key[key]["prompt"]["tokens"] == MAX_MODEL_LEN - 16
        assert by_key[key]["samples"][0]["prompt_tokens"] == MAX_MODEL_LEN - 16
        assert by_key[key]["metrics"]["ttft_s"] > 0
    skipped = by_key["long-512-ar"]
    assert skipped["metrics"] is None
    assert "with max_tokens 512 that is" in skipped["skipped"]
    assert "> max-model-len 512" in skipped["skipped"]


def ddops_bench(server, out: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "ops.cli",
        "--json",
        "bench",
        "--url",
        server.url,
        "--out",
        str(out),
        "--methods",
        "ar,linear,ddtree:4",
        "--lengths",
        "16,24",
        "--repeats",
        "3",
        "--time-budget",
        "0",
    ]


def wait_for_partial_cell(out: Path, process: subprocess.Popen) -> Path:
    """The run directory once a cell is stored and another has a measured request recorded."""
    deadline = time.monotonic() + KILL_WAIT_S
    while time.monotonic() < deadline:  # another process: the files are the only signal
        assert process.poll() is None, process.communicate()
        for run in out.glob("*/"):
            if list(run.glob("cell-*.json")) and list(run.glob("cell-*.partial.jsonl")):
                return run
        time.sleep(0.05)
    raise AssertionError("the bench stored no cell in time")


def test_a_bench_killed_mid_run_is_moved_aside_and_resumed(server, tmp_path):
    out = tmp_path / "results"
    first = subprocess.Popen(
        ddops_bench(server, out), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    run = wait_for_partial_cell(out, first)
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    assert read_json(run / MANIFEST)["state"] == RUNNING
    assert find_stale_runs(out) == [run]
    stored = {p.name for p in run.glob("cell-*.json")}
    partial = {p.name for p in run.glob("cell-*.partial.jsonl")}

    second = subprocess.run(ddops_bench(server, out), capture_output=True, text=True, timeout=600)

    assert second.returncode == 0, second.stderr
    document = json.loads(second.stdout)
    assert document["run_dir"] == str(run) and document["resumed"] is True
    assert document["state"] == "complete"
    assert len(document["rows"]) == 6 and all(r["decode_tok_s"] for r in document["rows"])
    manifest = read_json(run / MANIFEST)
    assert len(manifest["attempts"]) == 2 and len(manifest["crashes"]) == 1
    aside = run / manifest["crashes"][0]["moved_to"]
    assert {p.name for p in aside.iterdir()} >= partial
    assert stored <= {p.name for p in run.glob("cell-*.json")}
    assert (run / "report.md").exists() and (run / "results.csv").exists()
    assert "6/6" in second.stderr  # the progress bar (cells done / cells)
