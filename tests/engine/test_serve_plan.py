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
from tests.helpers import DATA, REPO
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


QWEN = DATA / "qwen36_27b"  # the published configs
DEMO = REPO / "engine" / "demo_model"


def qwen_serve_args(monkeypatch, *flags: str) -> argparse.Namespace:
    """serve's arguments for Qwen3.6-27B + drafter in bf16 on a 96 GiB device."""
    monkeypatch.setattr(serve, "available_memory", lambda device: 96 * GIB)
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    model = ["--model", str(QWEN / "target"), "--draft", str(QWEN / "draft")]
    return parser.parse_args([*model, "--dtype", "bfloat16", *flags])


def test_serve_plans_max_num_seqs_sequences_at_max_model_len(monkeypatch):
    args = qwen_serve_args(monkeypatch, "--max-model-len", "32768", "--max-num-seqs", "8")
    plan = serve.memory_plan(args)
    assert plan.sequences == 8 and serve.served_context(plan, args) == (32768, None)
    one = plan_from_dirs(QWEN / "target", QWEN / "draft", "bfloat16", 96 * GIB, 32768)
    # eight slots of 32k and their states (eight rounds' verify pass stays within a prefill
    # chunk's transient): seven more sequences' than one
    each = plan.sequence_kv_bytes(32768) + plan.recurrent_state
    assert plan.total_bytes(32768) - one.total_bytes(32768) == 7 * each
    assert plan.total_bytes(32768) <= 96 * GIB
    assert serve.sequences_note(plan, args) == (
        "sequences at once: 8, each up to 32768 tokens (9 fit)"
    )


def test_max_num_seqs_alone_shrinks_the_context_to_what_they_leave(monkeypatch):
    args = qwen_serve_args(monkeypatch, "--max-num-seqs", "8")
    plan = serve.memory_plan(args)
    limit, problem = serve.served_context(plan, args)
    assert problem is None and plan.sequences == 8
    assert 32768 < limit < 262_144 and plan.sequences_fitting(limit) == 8
    assert plan.total_bytes(limit) <= 96 * GIB < plan.total_bytes(limit + 1)


def test_more_sequences_than_fit_refuse_with_how_many_do(monkeypatch):
    args = qwen_serve_args(monkeypatch, "--max-model-len", "32768", "--max-num-seqs", "12")
    limit, problem = serve.served_context(serve.memory_plan(args), args)
    assert limit == 0
    assert problem.startswith("--max-num-seqs does not fit: 12 sequences of 32768 tokens need ")
    assert "9 fit at that length, or 12 at up to " in problem
    cached = qwen_serve_args(
        monkeypatch,
        "--max-model-len",
        "32768",
        "--max-num-seqs",
        "8",
        "--prefix-cache-memory",
        "8GiB",
    )
    limit, problem = serve.served_context(serve.memory_plan(cached), cached)
    assert limit == 0 and "7 fit at that length" in problem  # beside an 8 GiB prefix cache


def test_the_model_s_full_context_says_it_leaves_one_slot_and_what_to_pass(monkeypatch):
    args = qwen_serve_args(monkeypatch)
    plan = serve.memory_plan(args)
    assert plan.sequences == 1 and serve.served_context(plan, args) == (262_144, None)
    note = serve.sequences_note(plan, args)
    assert note.startswith("sequences at once: 1, each up to 262144 tokens (1 fit): ")
    assert "pass --max-model-len 32768 for 9 at once" in note
    shorter = qwen_serve_args(monkeypatch, "--max-model-len", "32768")
    plan = serve.memory_plan(shorter)
    assert plan.sequences == serve.DEFAULT_MAX_NUM_SEQS  # 9 fit: the default's 4 run
    assert "pass" not in serve.sequences_note(plan, shorter)


def test_sequences_that_cannot_fit_refuse_to_start_in_one_line(hybrid_dir):
    # a context a quarter of what this machine's free memory holds: ~4 sequences fit, not 1024
    plan = plan_from_dirs(hybrid_dir, None, "float32", serve.available_memory("cpu"))
    context = plan.longest_fit // 4
    done = subprocess.run(
        [sys.executable, "-m", "engine", "serve", "--model", str(hybrid_dir)]
        + ["--max-model-len", str(context), "--max-num-seqs", "1024", "--port", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    expected = f"Error: --max-num-seqs does not fit: 1024 sequences of {context} tokens need "
    assert lines[0].startswith(expected)
    assert " fit at that length" in lines[0]


def test_max_num_seqs_out_of_range_is_refused():
    done = subprocess.run(
        [sys.executable, "-m", "engine", "serve", "--model", "/nonexistent", "--max-num-seqs", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (done.returncode, done.stderr.strip()) == (
        2,
        "Error: --max-num-seqs must be from 1 to 1024",
    )


def test_the_server_s_cache_pool_is_the_plan_s(monkeypatch):
    """load_engine, given serve's plan, makes its sequences' slots for the served context and
    KV block pools within what the plan counts for them (and no less than their K/V)."""
    from engine.server.app import load_engine

    monkeypatch.setattr(serve, "available_memory", lambda device: 2 * GIB)
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    model = ["--model", str(DEMO / "target"), "--draft", str(DEMO / "draft")]
    args = parser.parse_args([*model, "--max-model-len", "4096", "--prefix-cache-memory", "64MiB"])
    plan = serve.memory_plan(args)
    context, _ = serve.served_context(plan, args)
    engine = load_engine(
        args.model,
        args.draft,
        "float32",
        "cpu",
        context,
        1,
        plan.prefix_cache_bytes,
        plan.sequences,
    )
    slots = engine.scheduler.free
    assert len(slots) == plan.sequences == serve.DEFAULT_MAX_NUM_SEQS
    assert engine.scheduler.slot_len >= context == 4096
    kv = slots[0].kv_bytes  # one pool per model, every slot's blocks in it
    counted = plan.sequences * plan.sequence_kv_bytes(context) + plan.prefix_cache_bytes
    held = plan.sequences * context * plan.cached_bytes_per_token + plan.prefix_cache_bytes
    assert held <= kv <= counted


def test_a_shared_kv_pool_takes_more_sequences_than_fit_whole(monkeypatch):
    """--kv-cache-tokens: sixteen 32k sequences share a 262,144-token pool (33.50 GiB) where
    sixteen whole slots would need 107 GiB; seven of them fit it at once, then preemption."""
    flags = ("--max-model-len", "32768", "--max-num-seqs", "16")
    whole = qwen_serve_args(monkeypatch, *flags)
    assert serve.served_context(serve.memory_plan(whole), whole)[0] == 0  # refused
    args = qwen_serve_args(monkeypatch, *flags, "--kv-cache-tokens", "262144")
    plan = serve.memory_plan(args)
    assert serve.served_context(plan, args) == (32768, None)
    assert plan.sequences == 16 and plan.sequences_fitting(32768) == 262_144 // 32_784 == 7
    assert plan.total_bytes(32768) - plan.fixed_bytes == 262_144 * plan.bytes_per_token
    assert "sharing a KV pool of 262144 tokens (7 of that length at once" in (
        serve.sequences_note(plan, args)
    )


def test_a_kv_pool_too_large_or_too_small_for_one_sequence_refuses(monkeypatch):
    flags = ("--max-model-len", "32768", "--max-num-seqs", "16")
    large = qwen_serve_args(monkeypatch, *flags, "--kv-cache-tokens", "400000")
    limit, problem = serve.served_context(serve.memory_plan(large), large)
    assert limit == 0 and problem.startswith(
        "--kv-cache-tokens does not fit: kv_cache_tokens 400000 needs 109.16 GiB"
    )
    small = qwen_serve_args(monkeypatch, *flags, "--kv-cache-tokens", "20000")
    limit, problem = serve.served_context(serve.memory_plan(small), small)
    assert (limit, problem) == (
        0,
        "--max-model-len does not fit: max_model_len 32768 does not fit a KV pool of 20000 "
        "tokens: a sequence alone needs 32784",
    )
