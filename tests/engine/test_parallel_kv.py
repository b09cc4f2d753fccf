"""Tensor parallelism at real size (engine/parallel.py), on the CPU with gloo.

More ranks than KV heads (Qwen3.6-27B: 4 KV heads, TP8): TP4 on a model of 2 KV heads decodes
like one rank; each rank reads only its own rows and columns of the checkpoint; a load failure
on one rank ends every rank with that rank's message. Its own
module: tests/engine/test_parallel.py keeps a process group open for its module, and a process has one.

Run: python -m pytest -q tests/engine/test_parallel_kv.py
"""

from __future__ import annotations

import json

import pytest
import torch

from engine.decode import GenerationConfig, generate
from engine.models import load_target
from engine.parallel import launch_target
from tests.helpers.checkpoint_reads import record_reads
from tests.helpers.parallel_pair import PROMPT, TOLERANCE, Pair, oracle_for, prefill_tree_chain
from tests.helpers.tiny_hybrid import save_tiny_hybrid
from tests.helpers.tiny_qwen3 import save_tiny_qwen3


def test_four_ranks_over_two_kv_heads_decode_like_one(tmp_path):
    """TP4 on a model of 2 KV heads: each KV head is copied onto the two ranks whose query
    heads read it; logits, ar and ddtree output equal one rank's."""
    model_dir = save_tiny_qwen3(tmp_path / "m", seed=3, tokenizer=False)
    assert json.loads((model_dir / "config.json").read_text())["num_key_value_heads"] == 2
    whole = load_target(model_dir)
    sharded = launch_target(model_dir, torch.float32, "cpu", tp=4)
    try:
        assert sharded.shard.config.num_key_value_heads == 1
        expected_outputs = prefill_tree_chain(whole, (0, 1))
        for want, have in zip(expected_outputs, prefill_tree_chain(sharded, (0, 1)), strict=True):
            torch.testing.assert_close(have, want, atol=TOLERANCE, rtol=0)
        pair = Pair(whole, sharded)
        for method, budget in (("ar", 1), ("ddtree", 6)):
            cfg = GenerationConfig(method=method, budget=budget, max_new_tokens=16)
            drafter = oracle_for(pair, seed=1)
            expected = generate(whole, drafter, PROMPT, cfg).output_ids
            assert generate(sharded, drafter, PROMPT, cfg).output_ids == expected
    finally:
        sharded.close()


@pytest.mark.parametrize(
    ("kind", "lm_head"), [("dense", "replicated"), ("hybrid", "sharded"), ("tied", "sharded")]
)
def test_each_rank_reads_only_its_own_slices(tmp_path, monkeypatch, kind, lm_head):
    from engine.parallel import load_shard, shard_model

    if kind == "hybrid":
        model_dir = save_tiny_hybrid(tmp_path / "m", seed=3, tokenizer=False)
    else:
        model_dir = save_tiny_qwen3(
            tmp_path / "m", seed=3, tokenizer=False, tie_word_embeddings=kind == "tied"
        )
    whole = load_target(model_dir)
    whole_elements = sum(p.numel() for p in whole.parameters())
    embeddings = whole.embed_tokens.weight.numel()
    expected = [shard_model(load_target(model_dir), rank, 2, lm_head) for rank in range(2)]
    reads = record_reads(monkeypatch)
    for rank in range(2):
        reads.clear()
        shard, head, _ = load_shard(model_dir, torch.float32, "cpu", rank, 2, lm_head)
        read = sum(reads.elements) - (
            head.weight.numel() if rank == 0 and lm_head == "sharded" else 0
        )
        params = dict(shard.named_parameters())
        for name, param in expected[rank].named_parameters():
            assert torch.equal(params[name], param), name
        assert read == sum(p.numel() for p in shard.parameters())  # nothing more is read
        assert read < whole_elements - embeddings / 2  # the layers are split
        if rank == 0:
            assert torch.equal(head.weight, whole.lm_head.weight)
        else:
            assert head is None


def _failing_rank(init_method: str) -> None:
    """Rank 1 of a two-rank gloo group whose load failed."""
    from engine.parallel import agree_loaded, init_group

    init_group(1, 2, "cpu", init_method)
    try:
        agree_loaded("rank 1: FileNotFoundError: model-00002-of-00002.safetensors")
    except RuntimeError:
        pass  # every rank ends; this one's message went to the others
    finally:
        torch.distributed.destroy_process_group()


def test_a_load_failure_on_one_rank_ends_every_rank_with_its_message(tmp_path):
    import torch.multiprocessing as mp

    from engine.parallel import agree_loaded, init_group

    init_method = f"file://{tmp_path / 'store'}"
    follower = mp.get_context("spawn").Process(target=_failing_rank, args=(init_method,))
    follower.start()
    init_group(0, 2, "cpu", init_method)
    try:
        with pytest.raises(RuntimeError, match="rank 1: FileNotFoundError: model-00002"):
            agree_loaded(None)
    finally:
        torch.distributed.destroy_process_group()
        follower.join(60)
    assert follower.exitcode == 0
