"""The DFlash drafter (engine/models/dflash.py): z-lab layouts, cached drafting, training path.

Run: python -m pytest -q tests/engine/test_dflash.py
"""

from __future__ import annotations

import json

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
        save_tiny_dflash(tmp_path, target_dir, num_layers=1, sliding_window=3), torch.float64
    )
    drafter.config.layer_types = ("sliding_attention",)
    features = target_features(target, drafter, [5, 9, 2, 31, 40, 7])
    changed = features.clone()
    # the bonus sits at 6; the first draft row (position 7) sees 5, 6, 7; only the bonus row,
    # whose logits are not returned, sees 4
    changed[:5] += 1.0
    a = drafter.draft(target, drafter.new_cache(6), features, bonus=3)
    b = drafter.draft(target, drafter.new_cache(6), changed, bonus=3)
    assert (a - b).abs().max() <= 1e-10
    changed[5] += 1.0
    c = drafter.draft(target, drafter.new_cache(6), changed, bonus=3)
    assert (a - c).abs().max() > 1e-3


@pytest.mark.parametrize("is_causal", [None, True, False])
def test_causal_layers_do_not_look_ahead_in_the_block(target, target_dir, tmp_path, is_causal):
    """Sliding layers are causal unless the config's is_causal says otherwise (z-lab rule)."""
    drafter = load_drafter(
        save_tiny_dflash(tmp_path, target_dir, num_layers=1, sliding_window=64), torch.float64
    )
    drafter.config.layer_types = ("sliding_attention",)
    drafter.config.is_causal = is_causal
    features = target_features(target, drafter, [5, 9, 2, 31])
    drafter.config.block_size = 3
    short = drafter.draft(target, drafter.new_cache(4), features, bonus=3)
    drafter.config.block_size = 6
    long = drafter.draft(target, drafter.new_cache(4), features, bonus=3)
    same_prefix = (short - long[:2]).abs().max() <= 1e-10
    assert same_prefix == (is_causal is not False)


def test_optional_scalars_and_dflash2_refusal(target, target_dir, tmp_path):
    drafter = load_drafter(save_tiny_dflash(tmp_path / "a", target_dir), torch.float64)
    features = target_features(target, drafter, [5, 9, 2])
    plain = drafter.draft(target, drafter.new_cache(3), features, bonus=3)
    drafter.config.output_multiplier, drafter.config.final_logit_softcapping = 2.0, 0.5
    capped = drafter.draft(target, drafter.new_cache(3), features, bonus=3)
    assert (capped - torch.tanh(plain * 2.0 / 0.5) * 0.5).abs().max() <= 1e-10
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    config["dflash_config"]["conv_kernel_size"] = 4
    (tmp_path / "a" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="DFlash2"):
        load_drafter(tmp_path / "a")


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
