"""`serve` makes the memory plan at start (engine/cli/serve.py).

    python -m pytest -q tests/engine/test_serve_plan.py            # fast: refusal, default context
    python -m pytest -q --slow tests/engine/test_serve_plan.py     # + a 25,000-token prompt over HTTP

A --max-model-len that cannot fit the device refuses to start with one line and exit 2, before
any model loads; without one, serve takes the longest context that fits (capped by the model's
own limit). At max_model_len 32,768 a tiny hybrid answers a 25,000-token prompt with 200 and the
same tokens as an unchunked run, and 32,769 tokens get a 400 with the numbers.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from engine.cli import serve
from engine.memory_plan import GIB, plan_from_dirs
from tests.helpers.engine_server import start_engine_server
from tests.helpers.tiny_hybrid import save_tiny_hybrid


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    return save_tiny_hybrid(tmp_path_factory.mktemp("serve-plan") / "hybrid", seed=0)


def serve_args(model, **overrides) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args(["--model", str(model)])
    return argparse.Namespace(**{**vars(args), **overrides})


def test_a_max_model_len_that_cannot_fit_refuses_to_start(hybrid_dir):
    done = subprocess.run(
        [sys.executable, "-m", "engine", "serve", "--model", str(hybrid_dir)]
        + ["--max-model-len", str(10**10), "--port", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: --max-model-len does not fit")
    assert "max_model_len 10000000000 needs" in lines[0] and "longest context" in lines[0]


def test_without_max_model_len_serve_takes_the_longest_context_that_fits(hybrid_dir, monkeypatch):
    args = serve_args(hybrid_dir)
    monkeypatch.setattr(serve, "available_memory", lambda device: 64 * GIB)
    assert serve.context_limit(args) == (512, None)  # the tiny model's own limit binds
    plan = plan_from_dirs(hybrid_dir, None, "float32", 64 * GIB)
    tight = plan.fixed_bytes + 300 * plan.bytes_per_token
    monkeypatch.setattr(serve, "available_memory", lambda device: tight)
    assert serve.context_limit(args) == (300, None)  # the memory binds
    monkeypatch.setattr(serve, "available_memory", lambda device: plan.fixed_bytes)
    limit, problem = serve.context_limit(args)
    assert limit == 0 and problem.startswith("the model does not fit")


def test_available_memory_on_the_cpu_is_what_the_kernel_reports():
    lines = Path("/proc/meminfo").read_text().splitlines()
    reported = next(
        int(line.split()[1]) * 1024 for line in lines if line.startswith("MemAvailable:")
    )
    assert abs(serve.available_memory("cpu") - reported) < 2 * GIB


@pytest.mark.slow
def test_a_25k_token_prompt_at_max_model_len_32768(hybrid_dir):
    """About a minute: a 25,000-token prefill in 2048-token chunks through the real server."""
    import torch

    from engine.decode import GenerationConfig, generate
    from engine.models import load_target
    from engine.tokenizer import load_tokenizer

    prompt = torch.randint(3, 128, (25_000,), generator=torch.Generator().manual_seed(0)).tolist()
    server = start_engine_server(hybrid_dir, extra_args=["--max-model-len", "32768"])
    try:
        with httpx.Client(base_url=server.url, timeout=600) as http:
            body = {"prompt": prompt, "max_tokens": 8, "temperature": 0}
            answer = http.post("/v1/completions", json=body)
            assert answer.status_code == 200, answer.text
            too_long = http.post("/v1/completions", json={**body, "prompt": prompt + [5] * 7769})
            assert too_long.status_code == 400
            assert "32769 tokens" in too_long.text and "32768" in too_long.text
            models = http.get("/v1/models").json()
    finally:
        server.stop()
    assert models["data"][0]["max_model_len"] == 32768
    served_text = answer.json()["choices"][0]["text"]
    cfg = GenerationConfig(method="ar", max_new_tokens=8, prefill_chunk=len(prompt))
    unchunked = generate(load_target(hybrid_dir), None, prompt, cfg).output_ids
    assert served_text == load_tokenizer(hybrid_dir).decode(unchunked)


def test_the_prefix_cache_gets_what_the_context_leaves_unless_asked_or_off(hybrid_dir, monkeypatch):
    monkeypatch.setattr(serve, "available_memory", lambda device: 64 * GIB)
    on = serve.memory_plan(serve_args(hybrid_dir, enable_prefix_caching=True))
    assert on.prefix_cache_bytes == 64 * GIB - on.total_bytes(512)  # the tiny model's 512 tokens
    asked = serve.memory_plan(serve_args(hybrid_dir, prefix_cache_memory="1GiB"))
    assert asked.prefix_cache_bytes == GIB
    off = serve.memory_plan(serve_args(hybrid_dir, enable_prefix_caching=False))
    assert off.prefix_cache_bytes == 0


def test_a_bad_prefix_cache_size_refuses_to_start(hybrid_dir):
    done = subprocess.run(
        [sys.executable, "-m", "engine", "serve", "--model", str(hybrid_dir)]
        + ["--prefix-cache-memory", "lots", "--port", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert (
        done.stderr.strip()
        == "Error: --prefix-cache-memory: not a size: 'lots' (e.g. 96GiB, 80GB, 512MiB)"
    )
