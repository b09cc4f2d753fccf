"""Tensor parallelism (engine/parallel.py) on the CPU with gloo: two ranks decode like one.

This pytest process is rank 0 and spawns rank 1, once per tiny model (dense with the lm_head
replicated on rank 0, hybrid with it vocab-sharded), so the tests drive the real leader/follower
protocol: logits and hidden states within 1e-5 of the whole model through prefill, a tree
verify, its commit and a chain; greedy ddtree (with a drafter that is often right, so trees are
accepted several tokens deep) and ar token for token. The slow test starts `serve --tp 2` (which
serves without a prefix cache, and says so).

Run: python -m pytest -q tests/engine/test_parallel.py [--slow]
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from engine.decode import GenerationConfig, generate
from engine.models import load_drafter, load_target
from engine.parallel import launch_target, shard_model
from engine.tokenizer import load_tokenizer
from tests.helpers.engine_server import start_engine_server
from tests.helpers.parallel_pair import PROMPT, TOLERANCE, Pair, oracle_for, prefill_tree_chain
from tests.helpers.tiny_hybrid import save_tiny_hybrid
from tests.helpers.tiny_qwen3 import save_tiny_dflash, save_tiny_qwen3

torch.set_num_threads(1)

CASES = {"dense": (save_tiny_qwen3, "replicated"), "hybrid": (save_tiny_hybrid, "sharded")}


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    save, lm_head = CASES[request.param]
    model_dir = save(tmp_path_factory.mktemp(request.param), seed=3, tokenizer=False)
    sharded = launch_target(model_dir, torch.float32, "cpu", tp=2, lm_head=lm_head)
    yield Pair(load_target(model_dir), sharded)
    sharded.close()


def test_logits_and_hidden_states_equal_one_rank(pair):
    expected = prefill_tree_chain(pair.whole, (0, 1))
    got = prefill_tree_chain(pair.sharded, (0, 1))
    for want, have in zip(expected, got, strict=True):
        assert have.shape == want.shape
        torch.testing.assert_close(have, want, atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize(
    ("method", "budget", "temperature"), [("ar", 1, 0.0), ("ddtree", 6, 0.0), ("ddtree", 6, 1.0)]
)
def test_output_equals_one_rank_token_for_token(pair, method, budget, temperature):
    drafter = oracle_for(pair, seed=budget)
    cfg = GenerationConfig(
        method=method, budget=budget, max_new_tokens=24, temperature=temperature, seed=7, trace=True
    )
    expected = generate(pair.whole, drafter, PROMPT, cfg)
    got = generate(pair.sharded, drafter, PROMPT, cfg)
    assert got.output_ids == expected.output_ids
    assert got.rounds == expected.rounds  # same trees, same accepted paths
    if method == "ddtree" and temperature == 0:
        assert max(got.acceptance_lengths) >= 3


@pytest.mark.slow
def test_generate_command_with_two_ranks_prints_what_one_rank_does(tmp_path):
    target_dir = save_tiny_qwen3(tmp_path / "target", seed=5, tokenizer=False)
    draft_dir = save_tiny_dflash(tmp_path / "draft", target_dir)
    argv = [sys.executable, "-m", "engine", "generate", "--model", str(target_dir)]
    argv += ["--draft", str(draft_dir), "--method", "ddtree", "--budget", "6", "--device", "cpu"]
    argv += ["--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", "12", "--json"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    documents = [
        json.loads(
            subprocess.run(argv + ["--tp", tp], env=env, capture_output=True, check=True).stdout
        )
        for tp in ("1", "2")
    ]
    assert documents[0]["output_ids"] == documents[1]["output_ids"]
    assert documents[0]["acceptance_lengths"] == documents[1]["acceptance_lengths"]


def test_refused_steps_leave_the_ranks_in_step(pair):
    stale = pair.sharded.new_cache(16)
    small = pair.sharded.new_cache(4)
    with pytest.raises(ValueError, match="one sequence"):
        pair.sharded.forward(torch.tensor(PROMPT), stale)  # refused before any rank runs it
    with pytest.raises(ValueError, match="KV cache full"):
        pair.sharded.forward(torch.tensor(PROMPT), small)  # refused by every rank alike
    test_logits_and_hidden_states_equal_one_rank(pair)


def test_heads_that_do_not_divide_are_refused(tmp_path):
    model = load_target(save_tiny_qwen3(tmp_path, tokenizer=False, intermediate_size=66))
    with pytest.raises(ValueError, match="intermediate_size: 66 is not divisible by --tp 4"):
        shard_model(model, rank=0, world=4)


def children_of(pid: int) -> list[int]:
    """Processes started by any thread of `pid` (the engine spawns its ranks off the main one)."""
    tasks = Path(f"/proc/{pid}/task").glob("*/children")
    return [int(child) for task in tasks for child in task.read_text().split()]


def wait_until_gone(pids: list[int], timeout: float = 30.0) -> list[int]:
    """The pids still alive after `timeout` (they are not our children: no wait() to await)."""
    deadline = time.monotonic() + timeout
    while (
        alive := [p for p in pids if Path(f"/proc/{p}").exists()]
    ) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive


@pytest.mark.slow
def test_server_with_two_ranks_answers_like_one_rank_and_stops_cleanly(tmp_path):
    target_dir = save_tiny_qwen3(tmp_path / "target", seed=5)
    draft_dir = save_tiny_dflash(tmp_path / "draft", target_dir)
    tokenizer = load_tokenizer(target_dir)
    prompt = "w1 w2 w3 w4"
    cfg = GenerationConfig(max_new_tokens=12, budget=6, stop_token_ids=tokenizer.eos_token_ids)
    drafter = load_drafter(draft_dir)
    expected = generate(load_target(target_dir), drafter, tokenizer.encode(prompt), cfg)
    server = start_engine_server(target_dir, draft_dir, extra_args=["--tp", "2", "--budget", "6"])
    try:
        body = {"prompt": prompt, "max_tokens": 12, "temperature": 0}
        response = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        again = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
        ranks = children_of(server.pid)
    finally:
        exit_code = server.stop()
    assert response.status_code == 200
    ids = [t for t in expected.output_ids if t not in tokenizer.eos_token_ids]
    assert response.json()["choices"][0]["text"] == tokenizer.decode(ids)
    assert exit_code == -signal.SIGTERM  # uvicorn re-raises SIGTERM after a graceful stop
    assert ranks and not wait_until_gone(ranks)  # the spawned rank ended with rank 0
    assert "Traceback" not in server.log_text()
    # over two ranks: one sequence at a time and no prefix cache, said once at start
    started = server.log_text()
    assert "tensor parallel (--tp 2): one sequence at a time" in started
    assert "no prefix cache; every prompt is prefilled" in started
    assert again["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert again["choices"][0]["text"] == response.json()["choices"][0]["text"]
