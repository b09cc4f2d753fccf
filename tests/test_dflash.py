"""The DFlash drafter (engine/models/dflash.py): z-lab layouts, cached drafting, training path.

Run: python -m pytest -q tests/test_dflash.py
"""

from __future__ import annotations

import pytest
import torch

from engine.models import load_drafter, load_target
from tests.helpers.tiny_qwen3 import save_tiny_dflash, save_tiny_qwen3

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return save_tiny_qwen3(tmp_path_factory.mktemp("target"), seed=0, tokenizer=False)


@pytest.fixture(scope="module")
def target(target_dir):
    return load_target(target_dir, dtype=torch.float64)


def target_features(target, drafter, ids: list[int]) -> torch.Tensor:  # [T, n*H]
    cache = target.new_cache(len(ids))
    _, hidden = target.forward(torch.tensor(ids), cache, hidden_layers=drafter.target_layer_ids)
    return hidden


def test_both_config_layouts_load_the_same_drafter(target_dir, tmp_path):
    old = load_drafter(save_tiny_dflash(tmp_path / "old", target_dir, seed=2, block_size=5))
    new = load_drafter(
        save_tiny_dflash(tmp_path / "new", target_dir, seed=2, block_size=5, new_layout=True)
    )
    for drafter in (old, new):
        assert drafter.block_size == 5
        assert drafter.mask_token_id == 0
        assert drafter.target_layer_ids == (0, 2)
        assert drafter.config.rope_theta == 10000.0
    assert all(torch.equal(a, b) for a, b in zip(old.parameters(), new.parameters(), strict=True))


@pytest.mark.parametrize("sliding_window", [None, 3], ids=["full", "sliding"])
def test_cached_drafting_equals_the_training_path(target, target_dir, tmp_path, sliding_window):
    drafter = load_drafter(
        save_tiny_dflash(tmp_path, target_dir, sliding_window=sliding_window), torch.float64
    )
    ids = [5, 9, 2, 31, 40, 7, 22, 13, 60, 3, 17]
    features = target_features(target, drafter, ids)
    cache = drafter.new_cache(len(ids))
    first = drafter.draft(target, cache, features[:6], bonus=ids[6])
    second = drafter.draft(target, cache, features[6:9], bonus=ids[9])
    assert cache.length == 9  # context kept, block discarded

    B = drafter.block_size
    blocks = torch.zeros(2, B, dtype=torch.long)
    blocks[:, 0] = torch.tensor([ids[6], ids[9]])
    trained = drafter.block_logits(target, features[:9], blocks, torch.tensor([6, 9]))
    assert first.shape == (B - 1, target.config.vocab_size)
    assert (trained[0] - first).abs().max() <= 1e-10
    assert (trained[1] - second).abs().max() <= 1e-10


def test_the_block_is_discarded_and_the_context_matters(target, target_dir, tmp_path):
    drafter = load_drafter(save_tiny_dflash(tmp_path, target_dir), torch.float64)
    ids = [5, 9, 2, 31, 40, 7, 22]
    features = target_features(target, drafter, ids)
    cache = drafter.new_cache(len(ids))
    drafter.draft(target, cache, features[:4], bonus=11)
    again = drafter.draft(target, cache, features[4:4], bonus=12)  # no new context
    fresh = drafter.draft(target, drafter.new_cache(len(ids)), features[:4], bonus=12)
    assert (again - fresh).abs().max() <= 1e-10
    other_context = drafter.draft(target, drafter.new_cache(len(ids)), features[1:5], bonus=12)
    assert (other_context - fresh).abs().max() > 1e-3


def test_sliding_window_layers_ignore_context_outside_the_window(target, target_dir, tmp_path):
    drafter = load_drafter(
        save_tiny_dflash(tmp_path, target_dir, num_layers=1, sliding_window=2), torch.float64
    )
    drafter.config.layer_types = ("sliding_attention",)
    features = target_features(target, drafter, [5, 9, 2, 31, 40, 7])
    changed = features.clone()
    changed[:5] += 1.0  # positions 0..4; the bonus sits at 6, so the window keeps 5 only
    a = drafter.draft(target, drafter.new_cache(6), features, bonus=3)
    b = drafter.draft(target, drafter.new_cache(6), changed, bonus=3)
    assert (a - b).abs().max() <= 1e-10


def test_block_logits_is_differentiable_over_batches_of_blocks(target, target_dir, tmp_path):
    drafter = load_drafter(save_tiny_dflash(tmp_path, target_dir), torch.float64).train()
    ids = [5, 9, 2, 31, 40, 7, 22, 13]
    features = target_features(target, drafter, ids)
    B = drafter.block_size
    blocks = torch.zeros(2, 2, B, dtype=torch.long)  # [batch, blocks, B]
    blocks[..., 0] = torch.tensor([[ids[2], ids[4]], [ids[3], ids[5]]])
    starts = torch.tensor([[2, 4], [3, 5]])
    logits = drafter.block_logits(target, features.expand(2, -1, -1), blocks, starts)
    assert logits.shape == (2, 2, B - 1, target.config.vocab_size)
    single = drafter.block_logits(target, features, blocks[1], starts[1])
    assert (logits[1] - single).abs().max() <= 1e-10
    logits.logsumexp(-1).sum().backward()
    assert drafter.fc.weight.grad is not None and drafter.fc.weight.grad.abs().sum() > 0
    assert drafter.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0
