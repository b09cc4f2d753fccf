"""The memory plan (engine/memory_plan.py, `python -m engine plan`).

    python -m pytest -q tests/engine/test_memory_plan.py

Qwen3.6-27B and its DFlash drafter (config fixtures in tests/data/qwen36_27b, no download) give
the figures computed here by hand from the published shapes; on the tiny real models the plan's
weights, KV per token and recurrent state equal what the loaded engine allocates, whole and per
tensor-parallel rank; the CLI prints the plan, refuses a context that cannot fit (one line,
exit 2) and bad input, and never imports torch.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from engine.memory_plan import GIB, MIB, parse_size, plan_from_configs, plan_from_dirs
from tests.helpers import DATA

QWEN36 = DATA / "qwen36_27b"
H, MLP, V = 5120, 17408, 248320

# Qwen3.6-27B by hand: parameters of one layer of each kind, then the whole model.
GDN_LAYER = (
    H * (2 * 16 * 128 + 48 * 128)  # in_proj_qkv: q and k (16 heads x 128), v (48 x 128)
    + H * 48 * 128  # in_proj_z
    + 2 * H * 48  # in_proj_a, in_proj_b
    + (2 * 16 * 128 + 48 * 128) * 4  # depthwise conv, kernel 4
    + 2 * 48  # A_log, dt_bias
    + 128  # gated norm
    + 48 * 128 * H  # out_proj
)
ATTENTION_LAYER = (
    H * 2 * 24 * 256 + 2 * H * 4 * 256 + 24 * 256 * H + 2 * 256
)  # q+gate, k, v, o, norms
MLP_AND_NORMS = 3 * H * MLP + 2 * H
TARGET_PARAMS = (
    2 * V * H + 48 * (GDN_LAYER + MLP_AND_NORMS) + 16 * (ATTENTION_LAYER + MLP_AND_NORMS) + H
)
DRAFT_LAYER = 2 * H * 32 * 128 + 2 * H * 8 * 128 + 2 * 128 + MLP_AND_NORMS
DRAFT_PARAMS = 5 * H * H + 2 * H + 5 * DRAFT_LAYER  # fc over 5 target layers, two norms
KV_PER_TOKEN = 16 * 2 * 4 * 256 * 2  # 16 attention layers, K and V, 4 heads x 256, bf16
DRAFT_KV_PER_TOKEN = 5 * 2 * 8 * 128 * 2
FEATURES_PER_TOKEN = 5 * H * 2
RECURRENT = 48 * ((2 * 16 * 128 + 48 * 128) * 3 * 2 + 48 * 128 * 128 * 4)  # conv bf16, state fp32


def qwen36_plan(device_memory: int, draft: bool = True, **options):
    return plan_from_dirs(
        QWEN36 / "target", QWEN36 / "draft" if draft else None, "bfloat16", device_memory, **options
    )


def test_qwen36_27b_weights_kv_and_state_are_the_published_shapes():
    plan = qwen36_plan(96 * GIB)
    assert TARGET_PARAMS == 26_895_998_464  # ~26.9 B: ~54 GB in bf16
    assert plan.target_weights == 2 * TARGET_PARAMS == 53_791_996_928
    assert plan.draft_weights == 2 * DRAFT_PARAMS == 3_460_426_240  # ~1.73 B
    assert plan.target_kv_per_token == KV_PER_TOKEN == 64 * 1024
    assert plan.draft_kv_per_token == DRAFT_KV_PER_TOKEN
    assert plan.context_features_per_token == FEATURES_PER_TOKEN
    assert plan.recurrent_state == RECURRENT  # ~147 MiB
    assert plan.transient == plan.prefill_transient > plan.verify_transient


def test_qwen36_27b_longest_context_on_96_and_64_gib():
    per_token = KV_PER_TOKEN + DRAFT_KV_PER_TOKEN + FEATURES_PER_TOKEN
    for memory in (96 * GIB, 64 * GIB):
        plan = qwen36_plan(memory)
        fixed = 2 * (TARGET_PARAMS + DRAFT_PARAMS) + RECURRENT + plan.transient + GIB
        assert plan.longest_fit == (memory - fixed) // per_token - 16  # a draft block beyond
    assert qwen36_plan(96 * GIB).longest_fit == 316_981
    assert qwen36_plan(96 * GIB).longest_context == 262_144  # the model's own limit binds
    assert qwen36_plan(64 * GIB).longest_context == 66_575
    alone = qwen36_plan(96 * GIB, draft=False)
    fixed = 2 * TARGET_PARAMS + RECURRENT + alone.transient + GIB
    assert alone.longest_fit == (96 * GIB - fixed) // KV_PER_TOKEN


def test_qwen36_27b_does_not_fit_48_gb_and_a_too_long_context_is_explained():
    assert qwen36_plan(48 * 10**9).longest_context == 0
    plan = qwen36_plan(64 * GIB, max_model_len=100_000)
    problem = plan.problem()
    assert "max_model_len 100000" in problem and "66575 tokens" in problem
    assert qwen36_plan(64 * GIB, max_model_len=66_575).problem() is None


def test_tensor_parallel_splits_layers_and_replicates_kv_heads_past_their_count():
    whole, tp8 = qwen36_plan(96 * GIB, draft=False), qwen36_plan(96 * GIB, draft=False, tp=8)
    embeddings = 2 * V * H * 2  # both whole on rank 0
    assert tp8.target_weights - embeddings < (whole.target_weights - embeddings) / 7
    assert tp8.target_kv_per_token == 16 * 2 * 1 * 256 * 2  # one (replicated) KV head a rank
    with pytest.raises(ValueError, match="divisible"):
        qwen36_plan(96 * GIB, tp=3)


@pytest.mark.parametrize("text", ["96GiB", "96 gib", "103079215104", "96G", "1.5TiB"])
def test_sizes_parse(text):
    expected = {"1.5TiB": 3 << 39, "103079215104": 96 * GIB}.get(text, 96 * GIB)
    assert parse_size(text) == expected
    assert parse_size("80GB") == 80 * 10**9


@pytest.mark.parametrize("bad", ["", "96 GiBs", "-1G", "lots"])
def test_bad_sizes_are_refused(bad):
    with pytest.raises(ValueError, match="not a size"):
        parse_size(bad)


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """(target, drafter or None) directories: dense Qwen3, hybrid, hybrid in Qwen3.6's layout."""
    from tests.helpers.qwen36_checkpoint import save_qwen36_checkpoint
    from tests.helpers.tiny_hybrid import save_tiny_hybrid, save_tiny_hybrid_drafter
    from tests.helpers.tiny_qwen3 import save_tiny_dflash, save_tiny_qwen3

    root = tmp_path_factory.mktemp("plan")
    dense = save_tiny_qwen3(root / "dense", tokenizer=False)
    hybrid = save_tiny_hybrid(root / "hybrid", tokenizer=False)
    return {
        "dense": (dense, save_tiny_dflash(root / "dense_draft", dense)),
        "hybrid": (hybrid, save_tiny_hybrid_drafter(root / "hybrid_draft", hybrid)),
        "qwen36_layout": (save_qwen36_checkpoint(root / "q36", layers=4, shards=2), None),
    }


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("kind", ["dense", "hybrid", "qwen36_layout"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_plan_equals_what_the_engine_allocates(tiny_models, kind, dtype):
    import torch

    from engine.models import load_drafter, load_target

    target_dir, draft_dir = tiny_models[kind]
    target = load_target(target_dir, getattr(torch, dtype))
    plan = plan_from_dirs(target_dir, draft_dir, dtype, 8 * GIB)
    assert plan.target_weights == nbytes(target.parameters())  # no vision tower, no mtp
    cache = target.new_cache(100)
    kv = cache.kv if kind != "dense" else cache
    assert plan.target_kv_per_token * 100 == nbytes([kv.k, kv.v])
    recurrent = [t for s in getattr(cache, "recurrent", []) for t in (s.conv, s.recurrent)]
    assert plan.recurrent_state == nbytes(recurrent)
    assert (plan.recurrent_state > 0) == (kind != "dense")
    if draft_dir is not None:
        drafter = load_drafter(draft_dir, getattr(torch, dtype))
        assert plan.draft_weights == nbytes(drafter.parameters())
        draft_cache = drafter.new_cache(100)
        draft_kv = nbytes([draft_cache.k, draft_cache.v])
        assert plan.draft_kv_per_token * (100 + plan.draft_block) == draft_kv


@pytest.mark.parametrize("kind", ["dense", "hybrid", "qwen36_layout"])
def test_plan_per_rank_equals_a_tensor_parallel_shard(tiny_models, kind):
    from engine.models import load_target
    from engine.parallel import shard_model

    target_dir, _ = tiny_models[kind]
    plan = plan_from_dirs(target_dir, None, "float32", 8 * GIB, tp=2)
    shard = shard_model(load_target(target_dir), rank=0, world=2)
    lm_head = shard.lm_head.weight  # rank 0 keeps the whole head
    assert lm_head.shape[0] == shard.embed_tokens.weight.shape[0]
    assert plan.target_weights == nbytes(shard.parameters())
    cache = shard.new_cache(10)
    kv = cache.kv if kind != "dense" else cache
    assert plan.target_kv_per_token * 10 == nbytes([kv.k, kv.v])
    recurrent = [t for s in getattr(cache, "recurrent", []) for t in (s.conv, s.recurrent)]
    assert plan.recurrent_state == nbytes(recurrent)


def run_plan(*args: str) -> subprocess.CompletedProcess:
    """`python -m engine plan ARGS`, failing if the command imported torch."""
    code = (
        "import sys\nfrom engine.__main__ import main\ncode = main(sys.argv[1:])\n"
        "assert 'torch' not in sys.modules, 'plan imported torch'\nsys.exit(code)"
    )
    return subprocess.run(
        [sys.executable, "-c", code, "plan", *args], capture_output=True, text=True
    )


def test_cli_prints_the_plan_without_importing_torch():
    done = run_plan("--model", str(QWEN36 / "target"), "--draft", str(QWEN36 / "draft"),
                    "--device-memory", "96GiB", "--json")  # fmt: skip
    assert done.returncode == 0, done.stderr
    document = json.loads(done.stdout)
    assert document["longest_context"] == 262_144
    assert document["target_kv_per_token"] == 65_536
    text = run_plan("--model", str(QWEN36 / "target"), "--device-memory", "96GiB")
    assert "longest context      262144 tokens" in text.stdout


def test_cli_refuses_a_context_that_cannot_fit_and_bad_input(tmp_path):
    done = run_plan("--model", str(QWEN36 / "target"), "--draft", str(QWEN36 / "draft"),
                    "--device-memory", "64GiB", "--max-model-len", "100000")  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "the longest context that fits is 66575" in done.stderr
    for args in (
        ("--model", str(tmp_path), "--device-memory", "96GiB"),
        ("--model", str(QWEN36 / "target"), "--device-memory", "lots"),
        ("--model", str(QWEN36 / "target"), "--device-memory", "96GiB", "--tp", "3"),
    ):
        done = run_plan(*args)
        assert done.returncode == 2 and done.stderr.startswith("Error: "), done.stderr
        assert "Traceback" not in done.stderr


def test_plan_from_configs_takes_the_dicts_ops_holds():
    target = json.loads((QWEN36 / "target" / "config.json").read_text())
    plan = plan_from_configs(target, None, "bfloat16", 96 * GIB, max_model_len=32_768)
    assert plan.problem() is None and plan.total_bytes(32_768) < 96 * GIB


def test_qwen36_27b_prefix_cache_figures_on_96_gib():
    """A cached token keeps the target's and the drafter's K/V (84 KiB); a GDN snapshot is the
    recurrent state of the 48 GDN layers (~147 MiB). By default the cache gets what the served
    context leaves: beside the model's whole 262,144 tokens about 7 GiB, beside 32,768 tokens
    about 36 GiB."""
    full, agent = qwen36_plan(96 * GIB), qwen36_plan(96 * GIB, max_model_len=32_768)
    assert full.cached_bytes_per_token == KV_PER_TOKEN + DRAFT_KV_PER_TOKEN == 86_016
    assert full.snapshot_bytes == RECURRENT
    assert full.prefix_cache_bytes == 96 * GIB - full.total_bytes(262_144)
    assert agent.prefix_cache_bytes == 96 * GIB - agent.total_bytes(32_768)
    conversation = 32_768 * 86_016 + 2 * RECURRENT + 2 * 256 * 86_016 + V * 4
    assert full.conversation_bytes(32_768) == conversation
    with_chunks = conversation + 16 * RECURRENT  # a snapshot per 2048-token chunk
    assert full.conversation_bytes(32_768, chunk_snapshots=True) == with_chunks
    assert (full.conversations_held(), full.conversations_held(chunk_snapshots=True)) == (2, 1)
    assert (agent.conversations_held(), agent.conversations_held(chunk_snapshots=True)) == (12, 6)


def test_qwen36_27b_kv_block_pool_figures_on_96_gib():
    """A KV block of 256 tokens is 16 MiB of the target's pool and 5 MiB of the drafter's; a
    32k-token prefix-cache hit hands over its 128 blocks (2.62 GiB) instead of copying them."""
    agent = qwen36_plan(96 * GIB, max_model_len=32_768)
    assert agent.block_bytes == 256 * (KV_PER_TOKEN + DRAFT_KV_PER_TOKEN) == 21 * MIB
    assert agent.hit_shared_bytes(32_768) == 128 * 21 * MIB
    assert agent.hit_shared_bytes(32_767) == 127 * 21 * MIB  # the tail block is copied on write
    document = agent.to_dict()
    assert (document["block_bytes"], document["hit_shared_bytes"]) == (21 * MIB, 2688 * MIB)
    assert any(line.startswith("KV blocks") and "2.62 GiB" in line for line in agent.lines())


def test_a_prefix_cache_asked_for_comes_out_of_the_context_and_off_is_zero():
    asked = qwen36_plan(96 * GIB, prefix_cache_memory=8 * GIB)
    default = qwen36_plan(96 * GIB)
    assert asked.prefix_cache_bytes == 8 * GIB
    assert asked.longest_fit == qwen36_plan(88 * GIB).longest_fit < default.longest_fit
    assert qwen36_plan(96 * GIB, prefix_caching=False).prefix_cache_bytes == 0
    dense = qwen36_plan(96 * GIB, draft=False)
    assert (
        dense.conversation_bytes(100)
        == 100 * KV_PER_TOKEN + 2 * RECURRENT + 2 * 256 * KV_PER_TOKEN + V * 4
    )


def test_cli_prints_the_prefix_cache_and_refuses_a_bad_size():
    base = (
        "--model",
        str(QWEN36 / "target"),
        "--draft",
        str(QWEN36 / "draft"),
        "--device-memory",
        "96GiB",
    )
    text = run_plan(*base, "--max-model-len", "32768").stdout
    assert (
        "prefix cache         36.32 GiB beside a context of 32768 (84.0 KiB per cached token, "
        in text
    )
    assert "12 conversations of 32768 tokens (6 with chunk snapshots)" in text
    assert "prefix cache         off" in run_plan(*base, "--no-enable-prefix-caching").stdout
    document = json.loads(run_plan(*base, "--prefix-cache-memory", "8GiB", "--json").stdout)
    assert document["prefix_cache_bytes"] == 8 * GIB and document["snapshot_bytes"] == RECURRENT
    bad = run_plan(*base, "--prefix-cache-memory", "lots")
    assert bad.returncode == 2 and bad.stderr.startswith("Error: not a size")


def test_sequences_fitting_is_the_most_whose_total_stays_within_the_device():
    for device in (64 * GIB, 96 * GIB, 141 * GIB):
        plan = qwen36_plan(device)
        for context in (4096, 32_768, 131_072):
            n = plan.sequences_fitting(context)
            within = replace(plan, sequences=max(1, n))
            beyond = replace(plan, sequences=n + 1)
            assert n == 0 or within.total_bytes(context) <= device
            assert beyond.total_bytes(context) > device
            assert (within.problem(context) is None) == (n >= 1)


def test_the_sequences_a_serve_command_plans():
    from engine.memory_plan import DEFAULT_MAX_NUM_SEQS, planned_sequences

    assert planned_sequences(8, None, 1) == 8
    assert planned_sequences(8, 262_144, 2) == 1  # tensor parallel: one at a time
    assert planned_sequences(None, 262_144, 1) == DEFAULT_MAX_NUM_SEQS  # they share the pool
    assert planned_sequences(None, None, 1) is None  # serve: as many as fit


def test_plan_counts_a_shared_kv_pool_as_serve_does():
    text = subprocess.run(
        [sys.executable, "-m", "engine", "plan", "--model", str(QWEN36 / "target")]
        + ["--draft", str(QWEN36 / "draft"), "--device-memory", "96GiB"]
        + ["--max-model-len", "32768", "--kv-cache-tokens", "262144"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert (
        "sequences at once    4, sharing a KV pool of 262144 tokens (33.50 GiB): "
        "7 of 32768 tokens at once" in text
    )
