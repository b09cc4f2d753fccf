"""engine/tools/soak.py against the real server app over the demo pair in float64, its KV pool two
blocks for four slots, so the scheduler preempts during the soak.

    python -m pytest -q tests/engine/tools/test_soak.py
"""

from __future__ import annotations

import json
import os

import pytest

from engine.memory_plan import BLOCK_TOKENS
from engine.server.app import load_engine
from engine.tools import soak
from tests.helpers.conversations import DEMO_TARGET
from tests.helpers.scripted_server import running

DEMO = DEMO_TARGET.parent

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_a_soak_with_preemptions_has_no_errors_and_answers_as_alone(capsys):
    def load():
        pair = DEMO / "target", DEMO / "draft"
        return load_engine(*pair, "float64", max_num_seqs=4, kv_tokens=2 * BLOCK_TOKENS)

    with running(load=load) as (url, _):
        argv = ["--url", url, "--pid", str(os.getpid()), "--requests", str(2 * len(soak.KINDS))]
        argv += ["--concurrency", "4", "--max-tokens", "6", "--long-tokens", "300"]
        code = soak.main([*argv, "--replay", "4", "--timeout", "120"])
    result = json.loads(capsys.readouterr().out)
    assert code == 0, result
    assert result["requests"] == 14 and result["server_errors"] == 0
    assert result["statuses"] == {"200": 14}, result["failures"]
    assert result["greedy_replays"] == {"replayed": 4, "equal": 4, "mismatches": []}
    assert result["preemptions"] > 0  # four slots over two blocks


def test_a_request_plan_covers_every_kind():
    args = soak.parse_args(["--url", "http://x", "--methods", "default,ar"])
    planned = [soak.plan(index, args, "long text") for index in range(2 * len(soak.KINDS))]
    assert {p.kind for p in planned} == set(soak.KINDS)
    assert {p.stream for p in planned if p.kind == "chat"} == {False, True}
    assert all(p.stream for p in planned if p.kind == "cancel")
    tools = next(p for p in planned if p.kind == "tools")
    assert tools.body["tools"][0]["function"]["name"] == "get_weather"
    schema = next(p for p in planned if p.kind == "json")
    assert schema.body["response_format"]["type"] == "json_schema"
    assert (
        "long text" in next(p for p in planned if p.kind == "long").body["messages"][0]["content"]
    )
    assert {p.body.get("speculative", {}).get("method") for p in planned} == {None, "ar"}
    assert [p.greedy for p in planned if p.kind in ("sampled", "cancel")] == [False] * 4
