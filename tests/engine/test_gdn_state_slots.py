"""GDN states as slots of one tensor a layer (engine/models/gated_deltanet.py `StateSlots`).

    python -m pytest -q tests/engine/test_gdn_state_slots.py

A batched pass's one-token steps read the states of sequences whose states are slots of one
`StateSlots` with one gather, and commit them with one scatter a layer: the states and outputs
equal those of states of their own, bit for bit (float64); a scheduler's slots share them.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine.cache_pool import CachePool
from engine.kernels.batched import ancestor_matrix
from engine.models.gated_deltanet import (
    GatedDeltaNet,
    GDNShape,
    RecurrentState,
    conv_taps,
    trees_layout,
    window_rows,
)
from tests.helpers.tiny_pairs import load_tiny_pair

SHAPE = GDNShape(
    hidden_size=32, key_heads=2, value_heads=4, key_dim=8, value_dim=8, conv_kernel=4, eps=1e-6
)
ROWS = 3


class Ops(TorchDispatchMode):
    """The aten ops run inside it, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func.overloadpacket).split(".")[-1])
        return func(*args, **(kwargs or {}))


def _layer() -> GatedDeltaNet:
    torch.manual_seed(0)
    layer = GatedDeltaNet(SHAPE).double()
    for parameter in layer.parameters():
        parameter.data.normal_(0.0, 0.3)
    return layer


def _randomised(states: list[RecurrentState], seed: int = 1) -> list[RecurrentState]:
    generator = torch.Generator().manual_seed(seed)
    for state in states:
        state.conv.copy_(torch.randn(state.conv.shape, generator=generator, dtype=torch.float64))
        noise = torch.randn(state.recurrent.shape, generator=generator, dtype=torch.float64)
        state.recurrent.copy_(noise)
    return states


@torch.no_grad()
def _steps(layer: GatedDeltaNet, states: list[RecurrentState], commit_rows: list[int]):
    """One-token steps of ROWS rows against `states`; the rows of `commit_rows` committed."""
    x = torch.randn(ROWS, SHAPE.hidden_size, generator=torch.Generator().manual_seed(2)).double()
    out, pending = layer.single_steps(layer._inputs(x), states)
    path = torch.zeros(1, dtype=torch.long)
    with Ops() as ops:
        layer.commit_many(
            [states[i] for i in commit_rows],
            [pending[i] for i in commit_rows],
            [path] * len(commit_rows),
            [0] * len(commit_rows),
        )
    return out, ops.names


@pytest.mark.parametrize("commit_rows", [[0, 1, 2], [2, 0]], ids=["every row", "some rows"])
def test_steps_of_shared_slots_equal_those_of_states_of_their_own(commit_rows: list[int]) -> None:
    layer = _layer()
    own = _randomised([layer.new_state(torch.float64, "cpu") for _ in range(ROWS)])
    shared = layer.new_states(ROWS, torch.float64, "cpu")
    assert all(state.slots is shared[0].slots for state in shared)
    for mine, theirs in zip(shared, own, strict=True):
        mine.conv.copy_(theirs.conv)
        mine.recurrent.copy_(theirs.recurrent)
    before = [state.recurrent.clone() for state in shared]

    out_own, _ = _steps(layer, own, commit_rows)
    out_shared, ops = _steps(layer, shared, commit_rows)

    assert torch.equal(out_shared, out_own)
    for i, (mine, theirs) in enumerate(zip(shared, own, strict=True)):
        assert torch.equal(mine.conv, theirs.conv)
        assert torch.equal(mine.recurrent, theirs.recurrent)
        assert torch.equal(mine.recurrent, before[i]) == (i not in commit_rows)
    assert ops.count("index_copy_") == 2  # one scatter a tensor, of every committed row
    assert "copy_" not in ops


@torch.no_grad()
def test_a_one_token_steps_path_can_only_be_its_token() -> None:
    layer = _layer()
    states = _randomised(layer.new_states(ROWS, torch.float64, "cpu"))
    x = torch.randn(ROWS, SHAPE.hidden_size, dtype=torch.float64)
    _, pending = layer.single_steps(layer._inputs(x), states)
    with pytest.raises(ValueError, match="ends at node 1"):
        layer.commit_many(states, pending, [torch.tensor([0, 1])] * ROWS, [1] * ROWS)


def test_a_schedulers_slots_share_their_gdn_states_and_keep_their_values(tmp_path) -> None:
    target, drafter = load_tiny_pair(tmp_path, "hybrid", dtype=torch.float64)
    pool = CachePool(target, drafter, 64)
    first = _randomised(pool.cache.recurrent)
    kept = [(state.conv.clone(), state.recurrent.clone()) for state in first]

    slots = pool.slots(3)

    for layer, (conv, recurrent) in enumerate(kept):
        states = [slot.cache.recurrent[layer] for slot in slots]
        assert [state.index for state in states] == [0, 1, 2]
        assert all(state.slots is states[0].slots for state in states)
        assert torch.equal(states[0].conv, conv)
        assert torch.equal(states[0].recurrent, recurrent)
        assert not states[1].recurrent.any()


@torch.no_grad()
def test_the_conv_windows_of_trees_mixed_together_are_committed_together() -> None:
    """A batched pass's trees (`factored_mix`) commit their conv windows in one gather and
    one scatter: each the window its own path leaves (`_commit_conv`, one tree alone)."""
    layer = _layer()
    trees = [torch.tensor([-1, 0, 0, 1, 3]), torch.tensor([-1, 0, 0, 2, 2])]
    paths = [[0, 1, 3, 4], [0, 2, 4]]
    states = _randomised(layer.new_states(len(trees), torch.float64, "cpu"))
    alone = _randomised([layer.new_state(torch.float64, "cpu") for _ in trees])
    x = torch.randn(10, SHAPE.hidden_size, generator=torch.Generator().manual_seed(3)).double()
    visible = [ancestor_matrix(tree) for tree in trees]
    layout = trees_layout([tree.numpy() for tree in trees], visible, SHAPE.conv_kernel)
    _, pending = layer.factored_mix(layer._inputs(x), states, layout)
    for state, kept, path in zip(alone, pending, paths, strict=True):
        layer._commit_conv(state, kept, torch.tensor(path))
    afters = [
        kept.tree_states.state_after(path[-1]) for kept, path in zip(pending, paths, strict=True)
    ]

    with Ops() as ops:
        layer.commit_many(
            states, pending, [torch.tensor(path) for path in paths], [p[-1] for p in paths]
        )

    for state, expected, after in zip(states, alone, afters, strict=True):
        assert torch.equal(state.conv, expected.conv)
        torch.testing.assert_close(state.recurrent, after, rtol=1e-12, atol=1e-12)
    # One scatter for the windows, one for the states (trees of one size are solved stacked).
    assert ops.names.count("index_copy_") == 2
    assert "copy_" not in ops.names


def test_a_batched_pass_walks_the_conv_windows_of_all_its_trees_at_once() -> None:
    """`trees_layout` reads each node's conv window from one set of rows, every tree's
    committed inputs then every tree's tokens: the same rows, in the same order, that the
    tree's own `conv_taps` reads from its own window rows. Trees of one size stack."""
    trees = [torch.tensor([-1, 0, 0, 1, 3]), torch.tensor([-1, 0, 1]), torch.tensor([-1, 0, 0, 2])]
    trees.append(torch.tensor([-1, 0, 1, 1, 0]))
    kernel, channels = SHAPE.conv_kernel, 3
    generator = torch.Generator().manual_seed(5)
    committed = [torch.randn(channels, kernel - 1, generator=generator) for _ in trees]
    tokens = [torch.randn(len(tree), channels, generator=generator) for tree in trees]
    visible = [ancestor_matrix(tree) for tree in trees]
    layout = trees_layout([tree.numpy() for tree in trees], visible, kernel)
    rows = torch.cat([*(conv.T for conv in committed), *tokens])
    for tree, conv, x, first in zip(trees, committed, tokens, layout.firsts, strict=True):
        own = window_rows(conv, x)[conv_taps(tree, kernel)]
        assert torch.equal(rows[layout.taps[first : first + len(tree)]], own)
    assert [(group.size, group.members) for group in layout.groups] == [
        (5, [0, 3]),
        (3, [1]),
        (4, [2]),
    ]
