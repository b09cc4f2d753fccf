"""The real `python -m engine serve` process refusing an empty API key, and stopping (SIGTERM)
with requests in flight: the running stream ends with a 503 error event, the waiting request is
a 503, and the log has no traceback.

The target is the tests' tiny Qwen3 with the eos row of its lm_head zeroed: the eos logit is 0,
below the top one, so its greedy output never ends (it would stop after 129 tokens otherwise)
and a generation is surely running when the signal comes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from safetensors.torch import load_file, save_file

from tests.helpers.engine_server import start_engine_server
from tests.helpers.tiny_qwen3 import SPECIAL_TOKENS, save_tiny_qwen3
from tests.helpers.tiny_tokenizer import BYTE_VOCAB_SIZE, save_byte_tokenizer

MAX_MODEL_LEN = 16384


def save_endless_target(path):
    target = save_tiny_qwen3(
        path, vocab_size=BYTE_VOCAB_SIZE, tokenizer=False, max_position_embeddings=MAX_MODEL_LEN
    )
    save_byte_tokenizer(target)
    weights_file = target / "model.safetensors"
    weights = load_file(weights_file)
    weights["lm_head.weight"][SPECIAL_TOKENS.index("<|im_end|>")] = 0.0
    save_file(weights, weights_file, metadata={"format": "pt"})
    return target


def test_an_empty_api_key_refuses_to_start(tmp_path):
    env = {**os.environ, "DDOPS_API_KEY": ""}
    argv = [sys.executable, "-m", "engine", "serve", "--model", str(tmp_path), "--port", "1"]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.startswith("Error: the API key (--api-key or DDOPS_API_KEY) is empty")
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr


def queue_waiting(http: httpx.Client) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith("ddops_engine_queue_waiting "):
            return float(line.split()[1])
    raise AssertionError("no ddops_engine_queue_waiting in /metrics")


@pytest.mark.slow
def test_requests_in_flight_at_sigterm_are_answered_503(tmp_path):
    target = save_endless_target(tmp_path / "endless")
    # one slot: the second request waits in the queue (with more it would run beside the first)
    extra = [
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--shutdown-grace-s",
        "0",
        "--max-num-seqs",
        "1",
    ]
    server = start_engine_server(target, extra_args=extra, log_path=tmp_path / "server.log")
    body = {"prompt": "the cat", "max_tokens": MAX_MODEL_LEN - 100, "temperature": 0}
    try:
        with httpx.Client(base_url=server.url, timeout=120) as http, ThreadPoolExecutor(1) as pool:
            with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as stream:
                lines = (line for line in stream.iter_lines() if line)
                assert next(lines).startswith("data: {")  # the generation is running
                waiting = pool.submit(http.post, "/v1/completions", json=body)
                deadline = time.monotonic() + 60
                while queue_waiting(http) < 1:
                    assert time.monotonic() < deadline, "the second request never queued"
                server.process.send_signal(signal.SIGTERM)
                *chunks, error, done = [line.removeprefix("data: ") for line in lines]
            assert done == "[DONE]"
            assert json.loads(error)["error"]["message"] == "server shutting down"
            assert all(json.loads(c)["choices"][0]["finish_reason"] is None for c in chunks)
            cut = waiting.result()
            assert cut.status_code == 503
            assert cut.json()["error"]["code"] == "shutting_down"
        assert server.process.wait(60) == -signal.SIGTERM
    finally:
        server.stop()
    log = server.log_text()
    assert "Traceback" not in log and "Exception in ASGI application" not in log
    assert "Application shutdown complete" in log
