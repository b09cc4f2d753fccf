"""DDTree construction, layout and walk (engine/tree.py).

Run: python -m pytest -q tests/engine/test_tree.py
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from engine import tree as tree_module
from engine.tree import (
    DraftTree,
    build_tree,
    chain_tree,
    depths_and_mask,
    top_k_log_probs,
    tree_layout,
    walk,
)


def random_top_k(depth: int, k: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    logits = torch.randn(depth, 50, generator=torch.Generator().manual_seed(seed)) * 2
    return top_k_log_probs(logits, k)


def node_paths(tree) -> list[tuple[int, ...]]:
    """Each node's path as ranks-free token tuples, root-first."""
    paths: list[tuple[int, ...]] = []
    for token, parent in zip(tree.tokens.tolist(), tree.parents.tolist(), strict=True):
        paths.append((paths[parent - 1] if parent else ()) + (token,))
    return paths


@pytest.mark.parametrize("budget", [1, 4, 15, 40])
def test_tree_holds_the_budget_most_likely_prefixes(budget):
    log_probs, ids = random_top_k(depth=3, k=budget, seed=budget)
    tree = build_tree(log_probs, ids, budget)
    scores = {}
    for depth in range(1, 4):
        for ranks in itertools.product(range(log_probs.shape[1]), repeat=depth):
            path = tuple(int(ids[d, r]) for d, r in enumerate(ranks))
            scores[path] = sum(float(log_probs[d, r]) for d, r in enumerate(ranks))
    best = sorted(scores, key=scores.get, reverse=True)[:budget]
    assert tree.size == budget
    assert set(node_paths(tree)) == set(best)


def test_parents_precede_children_and_scores_never_rise_in_build_order():
    log_probs, ids = random_top_k(depth=6, k=64, seed=7)
    tree = build_tree(log_probs, ids, 64)
    assert all(p < i + 1 for i, p in enumerate(tree.parents.tolist()))
    depth_of = depths_and_mask(tree.verify_parents())[0][1:]
    rank_of = [
        int(np.where(ids[d - 1] == t)[0][0]) for d, t in zip(depth_of, tree.tokens, strict=True)
    ]
    score = [float(log_probs[d - 1, r]) for d, r in zip(depth_of, rank_of, strict=True)]
    cumulative = []
    for i, parent in enumerate(tree.parents.tolist()):
        cumulative.append(score[i] + (cumulative[parent - 1] if parent else 0.0))
    assert all(a >= b for a, b in itertools.pairwise(cumulative))


def test_ties_are_broken_deterministically_in_push_order():
    log_probs = np.full((3, 4), np.log(0.25))
    ids = np.tile(np.arange(4), (3, 1))
    first = build_tree(log_probs, ids, 10)
    again = build_tree(log_probs.copy(), ids.copy(), 10)
    assert first.tokens.tolist() == again.tokens.tolist()
    assert first.parents.tolist() == again.parents.tolist()
    # equal depth-1 scores: siblings first in rank order, children after all better prefixes
    assert first.tokens.tolist()[:4] == [0, 1, 2, 3]
    assert first.parents.tolist()[:4] == [0, 0, 0, 0]


def test_tree_respects_depth_and_budget_limits():
    log_probs, ids = random_top_k(depth=2, k=5, seed=1)
    tree = build_tree(log_probs, ids, 100)
    assert tree.size == 5 + 25  # every prefix of depth <= 2 over 5 ranks
    assert build_tree(log_probs, ids, 0).size == 0
    assert build_tree(log_probs[:0], ids[:0], 8).size == 0


def test_chain_tree_is_a_path():
    chain = chain_tree(np.array([5, 6, 7]))
    assert chain.parents.tolist() == [0, 1, 2]
    assert chain.verify_parents().tolist() == [-1, 0, 1, 2]


def test_depths_and_ancestor_mask():
    depths, mask = depths_and_mask(np.array([-1, 0, 0, 1, -1]))
    assert depths.tolist() == [0, 1, 1, 2, 0]
    expected = np.array(
        [
            [1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [1, 0, 1, 0, 0],
            [1, 1, 0, 1, 0],
            [0, 0, 0, 0, 1],
        ],
        dtype=bool,
    )
    assert (mask == expected).all()
    chain_depths, chain_mask = tree_layout(None, 3, torch.device("cpu"))
    assert chain_depths.tolist() == [0, 1, 2] and chain_mask is None


def test_walk_follows_the_targets_choices_and_returns_the_first_miss():
    # verify index 0 = root; nodes 1..5 with tokens 10..14; 1, 2 under the root, 3, 4 under 1,
    # 5 under 4
    tree = DraftTree(np.array([10, 11, 12, 13, 14]), np.array([0, 0, 1, 1, 4]))
    accepted, bonus = walk(tree, [11, 13, 77, 0, 14, 99])
    assert accepted == [0, 2] and bonus == 77  # node 2 has no children: its choice is the bonus
    accepted, bonus = walk(tree, [10, 13, 0, 0, 14, 99])
    assert accepted == [0, 1, 4, 5] and bonus == 99
    accepted, bonus = walk(tree, [10, 55, 0, 0, 14, 99])
    assert accepted == [0, 1] and bonus == 55  # no child of node 1 carries 55
    accepted, bonus = walk(chain_tree(np.zeros(0, np.int64)), [42])
    assert accepted == [0] and bonus == 42


def test_device_paths_are_copied_to_the_device_only_when_read(monkeypatch):
    """A batched commit's paths (engine/models/qwen3_5.py `commit_batch`): most of its states
    are built from what the pass kept, so a path is copied to the device only when read,
    once."""
    copies = []
    real = tree_module.to_device
    monkeypatch.setattr(tree_module, "to_device", lambda a, d: copies.append(a) or real(a, d))
    paths = tree_module.DevicePaths([[0, 2, 5], [0], [0, 1]], torch.device("cpu"))
    assert len(paths) == 3 and not copies
    assert paths[2].tolist() == [0, 1] and paths[2] is paths[2]
    assert paths[0].tolist() == [0, 2, 5]
    assert [array.tolist() for array in copies] == [[0, 1], [0, 2, 5]]
