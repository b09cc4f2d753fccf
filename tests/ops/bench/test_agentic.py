"""The bench's agentic scenario: a coding agent's tool-using conversation growing to ~context.

Each turn's prompt is checked against the demo pair's chat template rendering the same OpenAI
messages and tools (byte-identical: the bench speaks Qwen3's format), sized with the demo pair's
real tokenizer. The slow test runs the scenario per method against a real `python -m engine serve`.
"""

from __future__ import annotations

import json

import pytest

from engine.tokenizer import load_tokenizer
from ops.bench.client import EngineClient
from ops.bench.figures import rows_from_cells
from ops.bench.matrix import AgenticShape, BenchConfig, parse_methods
from ops.bench.prompts import AGENT_TOOLS, AgenticTranscript
from ops.bench.runner import NullProgress, run_bench
from ops.results import RunStore
from tests.helpers.conversations import DEMO_TARGET
from tests.helpers.engine_server import start_engine_server

DEMO = load_tokenizer(DEMO_TARGET)
ANSWERS = ["I will read the parser first.", "", "\nThe loop stops one line early."]


def count(text: str) -> int:
    return len(DEMO.encode(text))


def test_every_turn_is_the_demo_templates_rendering_of_the_conversation():
    shape = AgenticShape(context=4096, turns=4)
    transcript = AgenticTranscript(count, shape, max_tokens=64, max_model_len=8192)
    assert transcript.skipped is None
    prompts = []
    for turn, answer in enumerate(["", *ANSWERS]):
        fitted = transcript.prompt_for_turn(turn, answer)
        assert fitted.skipped is None and fitted.tokens == transcript.turn_target(turn)
        rendered = DEMO.render_chat(transcript.messages, tools=list(AGENT_TOOLS))
        assert fitted.prompt == rendered
        prompts.append(fitted)
    assert prompts[-1].tokens == 4096 - 64
    assert all(b.prompt.startswith(a.prompt) for a, b in zip(prompts, prompts[1:], strict=False))
    calls = [m["tool_calls"][0]["function"] for m in transcript.messages if m.get("tool_calls")]
    assert [json.loads(c["arguments"])["path"] for c in calls] == [
        "textwrap.py",
        "json/decoder.py",
        "shlex.py",
    ]
    results = [m["content"] for m in transcript.messages if m["role"] == "tool"]
    assert results[1].startswith('"""Implementation of JSONDecoder')  # json/decoder.py's source
    assert '{"type": "function", "function": {"name": "run_tests"' in prompts[0].prompt


@pytest.mark.slow
def test_the_agentic_scenario_runs_per_method_against_serve(tmp_path):
    demo_draft = DEMO_TARGET.parent / "draft"
    extra = ["--max-model-len", "2048", "--budget", "8"]
    log = tmp_path / "serve.log"
    server = start_engine_server(DEMO_TARGET, demo_draft, extra_args=extra, log_path=log)
    try:
        config = BenchConfig(
            methods=parse_methods("ar,ddtree:8"),
            lengths=(16,),
            scenarios=("agentic",),
            warmup=0,
            repeats=2,
            time_budget_s=0,
            agentic=AgenticShape(context=1200, turns=3),
        )
        with EngineClient(server.url) as client:
            store = RunStore.open(tmp_path / "results", {"bench": config.to_json()}, {})
            cells = run_bench(config, client, store, NullProgress()).cells
    finally:
        server.stop()
    assert [cell["cell"]["key"] for cell in cells] == ["agentic-16-ar", "agentic-16-ddtree-8"]
    for cell in cells:
        # per repeat and turn: the turn with the prefix cache on, then re-sent with it off
        samples = [s for s in cell["samples"] if s["repeat"] == 0]
        assert [(s["turn"], s.get("cache", "on")) for s in samples] == [
            *((0, "on"), (0, "off"), (1, "on"), (1, "off"), (2, "on"), (2, "off"))
        ]
        prompts = [s["prompt_tokens"] for s in samples]
        assert prompts == sorted(prompts) and prompts[-1] == 1200 - 16
        assert [s["completion_tokens"] for s in samples[1::2]] == [1, 1, 1]
        assert cell["agentic"]["final_context_tokens"] <= 1200
        assert cell["metrics"]["requests"] == 2 * 3 and cell["metrics"]["e2e_tok_s"] > 0
        # the prefix cache: from turn 2 on, the turn with it on reuses the session's history (its
        # previous prompt, give or take its last tokens re-tokenized); the re-send with it off
        # reuses nothing
        on, off = samples[0::2], samples[1::2]
        assert on[0]["cached_tokens"] < 64 and {s["cached_tokens"] for s in off} == {0}
        for before, turn in zip(on, on[1:], strict=False):
            assert before["prompt_tokens"] - 16 <= turn["cached_tokens"] < turn["prompt_tokens"]
    rows = {row["method"]: row for row in rows_from_cells(cells)}
    for row in rows.values():
        assert [t["turn"] for t in row["turns"]] == [0, 1, 2]
        assert all(t["ttft_on_s"]["n"] == 2 and t["ttft_off_s"]["n"] == 2 for t in row["turns"])
        assert row["turns"][2]["cached_tokens"] >= row["turns"][1]["prompt_tokens"] - 16
