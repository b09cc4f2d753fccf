"""GDN states as slots of one tensor a layer (engine/models/gated_deltanet.py `StateSlots`).

    python -m pytest -q tests/engine/test_gdn_state_slots.py

A batched pass's one-token steps read the states of sequences whose states are slots of one
`StateSlots` with one gather, and commit them as they run with one scatter a layer: the states
and outputs equal those of states of their own, bit for bit (float64); a scheduler's slots
share them.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine import transfer
from engine.cache_pool import CachePool
from engine.kernels.batched import ancestor_matrix
from engine.models.common import Segment
from engine.models.gated_deltanet import (
    INSTALLED,
    GatedDeltaNet,
    GDNShape,
    RecurrentState,
    conv_taps,
    trees_layout,
    window_rows,
)
from engine.transfer import DeviceIndices
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
def _steps(layer: GatedDeltaNet, states: list[RecurrentState]):
    """One-token steps of ROWS rows against `states` (committed as they run); the aten ops."""
    x = torch.randn(ROWS, SHAPE.hidden_size, generator=torch.Generator().manual_seed(2)).double()
    inputs = layer._inputs(x)
    with Ops() as ops:
        out = layer.single_steps(inputs, states)
    return out, ops.names


def test_steps_of_shared_slots_equal_those_of_states_of_their_own() -> None:
    layer = _layer()
    own = _randomised([layer.new_state(torch.float64, "cpu") for _ in range(ROWS)])
    shared = layer.new_states(ROWS, torch.float64, "cpu")
    assert all(state.slots is shared[0].slots for state in shared)
    for mine, theirs in zip(shared, own, strict=True):
        mine.conv.copy_(theirs.conv)
        mine.recurrent.copy_(theirs.recurrent)
    before = [state.recurrent.clone() for state in shared]

    out_own, _ = _steps(layer, own)
    out_shared, ops = _steps(layer, shared)

    assert torch.equal(out_shared, out_own)
    for i, (mine, theirs) in enumerate(zip(shared, own, strict=True)):
        assert torch.equal(mine.conv, theirs.conv)
        assert torch.equal(mine.recurrent, theirs.recurrent)
        assert not torch.equal(mine.recurrent, before[i])  # committed by the step itself
    assert ops.count("index_select") == 2  # one gather a tensor, of every row
    assert ops.count("index_copy_") == 2  # one scatter a tensor, of every row
    assert "copy_" not in ops


@torch.no_grad()
def test_a_one_token_steps_path_can_only_be_its_token() -> None:
    layer = _layer()
    states = _randomised(layer.new_states(ROWS, torch.float64, "cpu"))
    with pytest.raises(ValueError, match="ends at node 1"):
        layer.commit_many(states, [INSTALLED] * ROWS, [torch.tensor([0, 1])] * ROWS, [1] * ROWS)


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


@torch.no_grad()
def test_a_batched_pass_holds_no_copy_of_a_state_until_its_commit(tmp_path) -> None:
    """What a batched pass leaves for commit holds none of the state copies its GDN layers
    read (at Qwen3.6-27B a state is 146.8 MiB a sequence): its one-token steps were committed
    as they ran, and its trees solved stacked keep their factors, not the stack's copy."""
    target, _ = load_tiny_pair(tmp_path, "hybrid", dtype=torch.float64)
    caches = [slot.cache for slot in CachePool(target, None, 64).slots(4)]
    for length, cache in zip((5, 9, 7, 12), caches, strict=True):
        target.extend(torch.arange(3, 3 + length), cache)
    before = [state.recurrent.clone() for state in caches[0].recurrent]
    tree = torch.tensor([-1, 0, 0, 1])
    segments = [Segment(torch.tensor([5]), caches[0]), Segment(torch.tensor([6]), caches[1])]
    segments += [Segment(torch.tensor([7, 8, 9, 10]), cache, tree) for cache in caches[2:]]
    target.forward_batch(segments)
    assert all(kept is INSTALLED for cache in caches[:2] for kept in cache.pending)
    stepped = zip(caches[0].recurrent, before, strict=True)
    assert not any(torch.equal(state.recurrent, was) for state, was in stepped)
    for cache in caches[2:]:
        for kept in cache.pending:
            stack, _ = kept.tree_states.pieces[0].stacked
            assert stack.initial is None


@torch.no_grad()
def test_a_batched_pass_copies_its_state_slots_to_the_device_once_for_every_layer(
    tmp_path, monkeypatch
) -> None:
    """Every GDN layer of a batched pass gathers and commits the same sequences' state slots
    and the same trees' nodes: each set of indices reaches the device once a pass (a copy, and
    on CUDA a pinned staging, a layer before), however many layers read it."""
    target, _ = load_tiny_pair(tmp_path, "hybrid", dtype=torch.float64)
    caches = [slot.cache for slot in CachePool(target, None, 64).slots(3)]
    assert len(caches[0].recurrent) >= 2  # the point: more than one GDN layer
    for length, cache in zip((5, 9, 7), caches, strict=True):
        target.extend(torch.arange(3, 3 + length), cache)
    copies: list[tuple[int, ...]] = []
    copy = transfer.to_device
    monkeypatch.setattr(
        transfer,
        "to_device",
        lambda array, device: copies.append(tuple(array)) or copy(array, device),
    )
    tree = torch.tensor([-1, 0, 0, 1])
    segments = [Segment(torch.tensor([7, 8, 9, 10]), cache, tree) for cache in caches[1:]]
    target.forward_batch(segments)
    target.commit_batch([(caches[1], [0, 1, 3]), (caches[2], [0, 2])])
    # the slots, the trees' last nodes' rows, their places in the stack and last nodes
    assert sorted(copies) == [(0, 1), (1, 2), (3, 2), (3, 6)]


def test_device_indices_copy_each_set_once_and_keep_the_last_few() -> None:
    indices = DeviceIndices("cpu", keep=2)
    first = indices.of((0, 2))
    assert indices.of((0, 2)) is first and first.tolist() == [0, 2]
    indices.of((1,))
    indices.of((3,))  # a third set: the oldest goes
    assert indices.of((1,)).tolist() == [1] and indices.of((0, 2)) is not first
