"""The batched CPU gated delta rule (engine/kernels/batched.py) matches the per-token reference.

Tolerances (tests/helpers/kernel_cases.py) as for the Triton kernels; the state is float32 for
bf16 inputs, so it is compared at the float32 tolerance.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kernels import batched, reference
from tests.helpers.kernel_cases import TOLERANCE, TREE_SHAPES

TREES = {**TREE_SHAPES, "ddtree_like": [-1, 0, 0, 1, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]}


def _inputs(T: int, H: int, Dk: int, Dv: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q = F.normalize(randn(T, H, Dk), dim=-1).to(dtype)
    k = F.normalize(randn(T, H, Dk), dim=-1).to(dtype)
    v = randn(T, H, Dv).to(dtype)
    g = -torch.rand(T, H, generator=gen, dtype=torch.float64).to(dtype)
    beta = torch.rand(T, H, generator=gen, dtype=torch.float64).to(dtype)
    state = randn(H, Dk, Dv).to(reference.compute_dtype(dtype))
    return q, k, v, g, beta, state


def _random_tree(T: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return [int(torch.randint(-1, i, (1,), generator=gen)) for i in range(T)]


def _both(parents: list[int], dtype: torch.dtype, H: int = 2, Dk: int = 16, Dv: int = 8):
    q, k, v, g, beta, state = _inputs(len(parents), H, Dk, Dv, dtype)
    args = (q, k, v, g, beta, torch.tensor(parents), state, Dk**-0.5)
    return (
        batched.tree_gated_delta_rule(*args, return_states=True),
        reference.tree_gated_delta_rule(*args, return_states=True),
    )


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tree", sorted(TREES))
def test_every_tree_shape_matches_the_reference(tree: str, dtype: torch.dtype) -> None:
    (out, states), (expected_out, expected_states) = _both(TREES[tree], dtype)
    assert out.dtype == expected_out.dtype and states.dtype == expected_states.dtype
    torch.testing.assert_close(out, expected_out, **TOLERANCE[dtype])
    state_tolerance = TOLERANCE[torch.float64 if dtype == torch.float64 else torch.float32]
    torch.testing.assert_close(states, expected_states, **state_tolerance)


@pytest.mark.parametrize("seed", range(4))
def test_random_trees_and_head_shapes(seed: int) -> None:
    parents = _random_tree(20, seed)
    (out, states), (expected_out, expected_states) = _both(parents, torch.float64, 3, 24, 20)
    torch.testing.assert_close(out, expected_out, **TOLERANCE[torch.float64])
    torch.testing.assert_close(states, expected_states, **TOLERANCE[torch.float64])


def test_long_chains_are_solved_in_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(batched, "CHAIN_PIECE", 8)
    chain = list(range(-1, 29))  # 30 tokens: pieces of 8, 8, 8, 6
    q, k, v, g, beta, state = _inputs(len(chain), 2, 16, 8, torch.float64, seed=5)
    args = (q, k, v, g, beta, torch.tensor(chain), state, 0.25)
    out, tree_states = batched.solve_tree(*args)
    expected_out, expected_states = reference.tree_gated_delta_rule(*args, return_states=True)
    assert len(tree_states.pieces) == 4
    torch.testing.assert_close(out, expected_out, **TOLERANCE[torch.float64])
    for node in (0, 7, 8, 20, 29):
        torch.testing.assert_close(
            tree_states.state_after(node), expected_states[node], **TOLERANCE[torch.float64]
        )


def test_a_tree_longer_than_a_piece_is_solved_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(batched, "CHAIN_PIECE", 4)
    parents = _random_tree(12, seed=9)
    q, k, v, g, beta, state = _inputs(12, 2, 16, 8, torch.float64)
    _, tree_states = batched.solve_tree(q, k, v, g, beta, torch.tensor(parents), state, 0.25)
    assert len(tree_states.pieces) == 1


def test_state_after_any_node_is_that_nodes_state() -> None:
    parents = TREES["forest"]
    q, k, v, g, beta, state = _inputs(len(parents), 2, 16, 8, torch.float64)
    args = (q, k, v, g, beta, torch.tensor(parents), state, 0.25)
    _, tree_states = batched.solve_tree(*args)
    _, expected = reference.tree_gated_delta_rule(*args, return_states=True)
    for node in range(len(parents)):
        torch.testing.assert_close(
            tree_states.state_after(node), expected[node], **TOLERANCE[torch.float64]
        )


def test_the_state_after_a_node_written_over_the_trees_initial_state_is_that_nodes_state() -> None:
    """What a commit does: the tree's initial state is the committed one, written over."""
    parents = torch.tensor(TREES["forest"])
    q, k, v, g, beta, state = _inputs(len(parents), 2, 16, 8, torch.float64)
    _, expected = reference.tree_gated_delta_rule(
        q, k, v, g, beta, parents, state, 0.25, return_states=True
    )
    for node in range(len(parents)):
        committed = state.clone()
        _, tree_states = batched.solve_tree(q, k, v, g, beta, parents, committed, 0.25)
        assert tree_states.pieces[0].initial is committed
        assert tree_states.write_state_after(node, committed) is committed
        torch.testing.assert_close(committed, expected[node], **TOLERANCE[torch.float64])


def test_empty_tree_and_the_ancestor_matrix() -> None:
    q, k, v, g, beta, state = _inputs(0, 2, 16, 8, torch.float32)
    no_parents = torch.zeros(0, dtype=torch.int64)
    out, states = batched.tree_gated_delta_rule(q, k, v, g, beta, no_parents, state, 0.25, True)
    assert out.shape == (0, 2, 8) and states.shape == (0, 2, 16, 8)
    visible = batched.ancestor_matrix(torch.tensor([-1, 0, -1, 1]))
    assert visible.tolist() == [
        [True, False, False, False],
        [True, True, False, False],
        [False, False, True, False],
        [True, True, False, True],
    ]
    assert batched.is_chain(torch.tensor([-1, 0, 1])) and not batched.is_chain(
        torch.tensor([-1, -1])
    )


def test_held_bytes_are_what_the_gdn_layer_budgets_for() -> None:
    from engine.models.gated_deltanet import GDNShape, factored_bytes

    shape = GDNShape(
        hidden_size=64, key_heads=2, value_heads=2, key_dim=16, value_dim=8, conv_kernel=4, eps=1e-6
    )
    for parents in (list(range(-1, 149)), _random_tree(12, seed=3)):  # 3 chain pieces; a tree
        q, k, v, g, beta, state = _inputs(len(parents), 2, 16, 8, torch.float64)
        _, tree_states = batched.solve_tree(q, k, v, g, beta, torch.tensor(parents), state, 0.25)
        assert tree_states.nbytes() == factored_bytes(shape, len(parents), torch.float64)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("T", "prefix", "tree"),
    [(40, 0, None), (33, 70, None), (300, 70, None), (16, 50, "ddtree_like")],
)
def test_streaming_attention_matches_the_reference(T, prefix, tree, dtype) -> None:
    """The CPU attention (scaled_dot_product_attention, no score tensor) on a prefill chunk
    after a prefix, a first chunk, and a verify tree."""
    gen = torch.Generator().manual_seed(T)
    q = torch.randn(T, 6, 32, generator=gen, dtype=torch.float64).to(dtype)
    k, v = (
        torch.randn(prefix + T, 2, 32, generator=gen, dtype=torch.float64).to(dtype) for _ in "kv"
    )
    visible = None if tree is None else batched.ancestor_matrix(torch.tensor(TREES[tree]))
    args = (q, k, v, prefix, visible, 32**-0.5)
    out = batched.tree_attention(*args)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out, reference.tree_attention(*args), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_chain_conv_is_one_depthwise_conv_matching_the_reference(dtype, bias) -> None:
    gen = torch.Generator().manual_seed(2)
    x, state = torch.randn(30, 6, generator=gen), torch.randn(6, 5, generator=gen)
    weight, b = torch.randn(6, 4, generator=gen), torch.randn(6, generator=gen)
    args = (x.to(dtype), torch.arange(-1, 29), state.to(dtype), weight.to(dtype))
    args = (*args, b.to(dtype) if bias else None)
    out = batched.tree_causal_conv1d(*args)
    assert out.dtype == dtype
    torch.testing.assert_close(out, reference.tree_causal_conv1d(*args), **TOLERANCE[dtype])


@pytest.mark.parametrize("tree", [None, "ddtree_like"])
def test_cpu_attention_runs_the_streaming_kernel_not_the_math_one(tree) -> None:
    """The math fallback is what materialises [Hq, T, S] scores (and calls softmax)."""
    from torch.profiler import profile

    T = 16
    q, k, v = torch.randn(T, 6, 32), torch.randn(40 + T, 2, 32), torch.randn(40 + T, 2, 32)
    visible = None if tree is None else batched.ancestor_matrix(torch.tensor(TREES[tree]))
    with profile() as prof:
        batched.tree_attention(q, k, v, 40, visible, 32**-0.5)
    ops = {event.key for event in prof.key_averages()}
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in ops
    assert not {"aten::_softmax", "aten::softmax"} & ops


ONE_SIZE = [TREES["ddtree_like"], _random_tree(16, 2), _random_tree(16, 4)]
MIXED = [TREES["ddtree_like"], _random_tree(5, 1), _random_tree(16, 2), [-1], _random_tree(5, 3)]


@pytest.mark.parametrize(
    ("trees", "solves"), [(ONE_SIZE, 1), (MIXED, 3)], ids=["one_size", "mixed"]
)
def test_trees_of_one_size_are_solved_together_each_against_its_own_state(
    trees: list[list[int]], solves: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batched pass's verify trees (engine/models/gated_deltanet.py `solve_trees`): each
    tree's outputs and node states are its own solve's, with one solve per tree size."""
    from engine.kernels.batched import ancestor_matrix
    from engine.models.gated_deltanet import size_groups, solve_trees

    cases = [_inputs(len(tree), 2, 16, 8, torch.float64, seed=i) for i, tree in enumerate(trees)]
    q, k, v, g, beta = (torch.cat([case[n] for case in cases]) for n in range(5))
    masks = [ancestor_matrix(torch.tensor(tree)) for tree in trees]
    calls = []
    solve = torch.linalg.solve_triangular
    monkeypatch.setattr(
        torch.linalg, "solve_triangular", lambda *a, **kw: calls.append(1) or solve(*a, **kw)
    )
    sizes = [len(tree) for tree in trees]
    groups = size_groups(sizes, masks)
    out, pieces = solve_trees((q, k, v), g, beta, groups, [c[5] for c in cases], 0.25)
    assert len(calls) == solves
    rows, exact = 0, TOLERANCE[torch.float64]
    for tree, case, piece in zip(trees, cases, pieces, strict=True):
        args = (*case[:5], torch.tensor(tree), case[5], 0.25)
        expected_out, expected_states = reference.tree_gated_delta_rule(*args, return_states=True)
        torch.testing.assert_close(out[rows : rows + len(tree)], expected_out, **exact)
        assert piece.initial is case[5]  # its own state, not a stacked copy held to the commit
        for node in range(len(tree)):
            torch.testing.assert_close(piece.state_after(node), expected_states[node], **exact)
        rows += len(tree)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_states_of_trees_solved_together_are_built_together(dtype: torch.dtype) -> None:
    """A batched pass's commit (engine/models/gated_deltanet.py `commit_many`): the states
    after chosen nodes of trees solved stacked, built in one set of calls, are each tree's
    own: the reference's, and its own `state_after`'s."""
    from engine.kernels.batched import ancestor_matrix
    from engine.models.gated_deltanet import size_groups, solve_trees

    trees = MIXED
    cases = [_inputs(len(tree), 2, 16, 8, dtype, seed=i) for i, tree in enumerate(trees)]
    q, k, v, g, beta = (torch.cat([case[n] for case in cases]) for n in range(5))
    masks = [ancestor_matrix(torch.tensor(tree)) for tree in trees]
    sizes = [len(tree) for tree in trees]
    groups = size_groups(sizes, masks)
    _, pieces = solve_trees((q, k, v), g, beta, groups, [c[5] for c in cases], 0.25)
    stacks: dict[int, list[int]] = {}
    for i, piece in enumerate(pieces):
        stacks.setdefault(id(piece.stacked[0]), []).append(i)
    assert any(len(members) > 1 for members in stacks.values())
    for members in stacks.values():
        stack = pieces[members[0]].stacked[0]
        for chosen in (members, members[::-1][:2]):  # all in order; some, out of order
            nodes = [(3 * i) % sizes[i] for i in chosen]
            at = [pieces[i].stacked[1] for i in chosen]
            built = stack.write_states_after(at, nodes, torch.stack([cases[i][5] for i in chosen]))
            for i, node, state in zip(chosen, nodes, built, strict=True):
                args = (*cases[i][:5], torch.tensor(trees[i]), cases[i][5], 0.25)
                _, expected = reference.tree_gated_delta_rule(*args, return_states=True)
                torch.testing.assert_close(state, expected[node], **TOLERANCE[dtype])
                torch.testing.assert_close(state, pieces[i].state_after(node), **TOLERANCE[dtype])
