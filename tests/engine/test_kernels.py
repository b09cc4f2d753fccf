"""The Triton tree kernels match their plain-torch references (engine/kernels/reference.py).

The kernels run in Triton's CPU interpreter (tests/helpers/kernel_cases.py says how). Shapes stay
tiny: the interpreter costs ~0.5 ms per program.
Run: python -m pytest -q tests/engine/test_kernels.py

Tolerances: float32 inputs 1e-5 (same math, another summation order); bf16 inputs compare
against the reference on the same bf16 inputs at 1.6e-2 relative, one or two bf16 rounding
steps of the output (both compute in float32 and round once); float64 inputs 1e-12.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import engine.kernels as kernels
from engine.kernels import batched, reference
from tests.helpers.kernel_cases import (
    TOLERANCE,
    TREE_SHAPES,
    compiled_copy,
    import_interpreted,
    interpreter_for,
)

KERNEL_MODULES = (
    "engine.kernels.triton_attention",
    "engine.kernels.triton_conv",
    "engine.kernels.triton_gated_delta",
)


triton_attention, triton_conv, triton_gated_delta = map(import_interpreted, KERNEL_MODULES)


@pytest.fixture(scope="module", autouse=True)
def _interpreter_for_this_module() -> Iterator[None]:
    yield from interpreter_for(KERNEL_MODULES)


TREES = {**TREE_SHAPES, "random": None}  # "random" is drawn from a seed in _parents
# Every tree in float32; bf16 (slower to check, same code path) on a depth-1 tree, a chain, a
# wide tree and a random one.
TREE_CASES = [(tree, torch.float32) for tree in TREES] + [
    (tree, torch.bfloat16) for tree in ("all_roots", "chain", "wide", "random")
]


def _parents(tree: str, seed: int = 0) -> torch.Tensor:  # [T] int64
    if TREES[tree] is not None:
        return torch.tensor(TREES[tree], dtype=torch.int64)
    gen = torch.Generator().manual_seed(seed)
    picks = [int(torch.randint(-1, i, (1,), generator=gen)) for i in range(9)]
    return torch.tensor(picks, dtype=torch.int64)


def _ancestor_mask(parents: torch.Tensor) -> torch.Tensor:  # [T, T] bool
    """visible[i, j]: j is i or one of its ancestors (what the engine passes tree_attention)."""
    T = parents.shape[0]
    visible = torch.eye(T, dtype=torch.bool)
    for i, parent in enumerate(parents.tolist()):
        if parent >= 0:
            visible[i] |= visible[parent]
    return visible


def _randn(*shape: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)


def _assert_matches(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.dtype == expected.dtype
    assert actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, **TOLERANCE[dtype])


# --- gated delta rule -------------------------------------------------------------------------


def _delta_inputs(T: int, H: int, Dk: int, Dv: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(_randn(T, H, Dk, dtype=torch.float64, gen=gen), dim=-1).to(dtype)
    k = F.normalize(_randn(T, H, Dk, dtype=torch.float64, gen=gen), dim=-1).to(dtype)
    v = _randn(T, H, Dv, dtype=dtype, gen=gen)
    g = -torch.rand(T, H, generator=gen, dtype=torch.float64).to(dtype)  # log decay <= 0
    beta = torch.rand(T, H, generator=gen, dtype=torch.float64).to(dtype)
    initial_state = _randn(H, Dk, Dv, dtype=dtype, gen=gen)
    return q, k, v, g, beta, initial_state


@pytest.mark.parametrize(("tree", "dtype"), TREE_CASES)
def test_gated_delta_matches_reference_on_every_tree_shape(tree: str, dtype: torch.dtype) -> None:
    parents = _parents(tree)
    q, k, v, g, beta, state0 = _delta_inputs(len(parents), 2, 16, 16, dtype)
    args = (q, k, v, g, beta, parents, state0, 0.25)

    out, states = triton_gated_delta.tree_gated_delta_rule(*args, return_states=True)
    expected_out, expected_states = reference.tree_gated_delta_rule(*args, return_states=True)

    _assert_matches(out, expected_out, dtype)
    _assert_matches(states, expected_states, torch.float32)  # float32 state for bf16 too


@pytest.mark.parametrize("tree", ["wide", "forest", "random"])
def test_gated_delta_without_states_reloads_branch_points(tree: str) -> None:
    """Without return_states only branch points are snapshotted; the outputs stay exact."""
    parents = _parents(tree, seed=3)
    inputs = _delta_inputs(len(parents), 2, 16, 16, torch.float32, seed=1)
    args = (*inputs[:5], parents, inputs[5], 0.25)

    out, states = triton_gated_delta.tree_gated_delta_rule(*args)
    expected_out, _ = reference.tree_gated_delta_rule(*args)

    assert states is None
    _assert_matches(out, expected_out, torch.float32)


def test_gated_delta_snapshots_only_states_a_later_node_branches_from() -> None:
    parents = torch.tensor([-1, 0, 0, 1, -1, 4, 2])  # 2, 3, 6 branch off 0, 1, 2; 5 follows 4
    marks = triton_gated_delta._branch_points(parents)
    assert marks.tolist() == [1, 1, 1, 0, 0, 0, 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("T", [1, 9, 70])
def test_chain_gated_delta_keeps_only_the_last_state(T: int, dtype: torch.dtype) -> None:
    """A prefill chunk's recurrence: the chain's outputs and the state after its last token."""
    q, k, v, g, beta, state0 = _delta_inputs(T, 2, 16, 8, dtype, seed=4)
    chain = torch.arange(-1, T - 1)
    expected_out, states = reference.tree_gated_delta_rule(
        q, k, v, g, beta, chain, state0, 0.25, return_states=True
    )
    implementations = (reference, batched, triton_gated_delta)
    for impl in implementations:
        out, final = impl.chain_gated_delta_rule(q, k, v, g, beta, state0, 0.25)
        _assert_matches(out, expected_out, dtype)
        _assert_matches(final, states[-1], dtype)


@pytest.mark.parametrize(
    ("H", "Dk", "Dv"),
    [(3, 24, 20), (1, 128, 64), (2, 16, 40)],
    ids=["not_powers_of_two", "two_value_blocks", "masked_value_block"],
)
def test_gated_delta_head_shapes(H: int, Dk: int, Dv: int) -> None:
    parents = _parents("two_level")
    q, k, v, g, beta, state0 = _delta_inputs(len(parents), H, Dk, Dv, torch.float32, seed=2)
    args = (q, k, v, g, beta, parents, state0, Dk**-0.5)

    out, states = triton_gated_delta.tree_gated_delta_rule(*args, return_states=True)
    expected_out, expected_states = reference.tree_gated_delta_rule(*args, return_states=True)

    _assert_matches(out, expected_out, torch.float32)
    _assert_matches(states, expected_states, torch.float32)


# --- causal conv1d over a tree ---------------------------------------------------------------


def _conv_inputs(T: int, C: int, W: int, K: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = _randn(T, C, dtype=dtype, gen=gen)
    conv_state = _randn(C, W, dtype=dtype, gen=gen)
    weight = _randn(C, K, dtype=dtype, gen=gen)
    bias = _randn(C, dtype=dtype, gen=gen)
    return x, conv_state, weight, bias


@pytest.mark.parametrize(("tree", "dtype"), TREE_CASES)
def test_conv_matches_reference_on_every_tree_shape(tree: str, dtype: torch.dtype) -> None:
    parents = _parents(tree)
    x, conv_state, weight, bias = _conv_inputs(len(parents), 12, 3, 4, dtype)

    out = triton_conv.tree_causal_conv1d(x, parents, conv_state, weight, bias)

    expected = reference.tree_causal_conv1d(x, parents, conv_state, weight, bias)
    _assert_matches(out, expected, dtype)


@pytest.mark.parametrize(
    ("C", "W", "K", "with_bias", "activation"),
    [
        (300, 3, 4, True, "silu"),
        (7, 6, 4, False, None),
        (5, 1, 2, True, None),
        (5, 2, 1, False, "silu"),
    ],
    ids=["two_channel_blocks", "longer_state_no_bias", "kernel_2", "kernel_1"],
)
def test_conv_shapes_and_options(
    C: int, W: int, K: int, with_bias: bool, activation: str | None
) -> None:
    parents = _parents("random", seed=5)
    x, conv_state, weight, bias = _conv_inputs(len(parents), C, W, K, torch.float32, seed=4)
    bias = bias if with_bias else None

    out = triton_conv.tree_causal_conv1d(x, parents, conv_state, weight, bias, activation)

    expected = reference.tree_causal_conv1d(x, parents, conv_state, weight, bias, activation)
    _assert_matches(out, expected, torch.float32)


def test_conv_refuses_a_state_shorter_than_the_kernel() -> None:
    x, conv_state, weight, bias = _conv_inputs(2, 4, 2, 4, torch.float32)
    with pytest.raises(ValueError, match="conv_state holds 2 inputs"):
        triton_conv.tree_causal_conv1d(x, _parents("chain")[:2], conv_state, weight, bias)


# --- tree attention ---------------------------------------------------------------------------


def _attention_inputs(T: int, prefix_len: int, Hq: int, Hkv: int, D: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(T * 100 + prefix_len)
    q = _randn(T, Hq, D, dtype=dtype, gen=gen)
    k = _randn(prefix_len + T, Hkv, D, dtype=dtype, gen=gen)
    v = _randn(prefix_len + T, Hkv, D, dtype=dtype, gen=gen)
    return q, k, v


def _check_attention(parents, prefix_len, Hq, Hkv, D, dtype, causal=False, **launch) -> None:
    q, k, v = _attention_inputs(len(parents), prefix_len, Hq, Hkv, D, dtype)
    visible = None if causal else _ancestor_mask(parents)
    args = (q, k, v, prefix_len, visible, D**-0.5)

    out = triton_attention.tree_attention(*args, **launch)

    _assert_matches(out, reference.tree_attention(*args), dtype)


@pytest.mark.parametrize(("tree", "dtype"), TREE_CASES)
def test_attention_matches_reference_on_every_tree_shape(tree: str, dtype: torch.dtype) -> None:
    _check_attention(_parents(tree), 5, 4, 2, 16, dtype)


@pytest.mark.parametrize(
    ("Hq", "Hkv", "D"),
    [(2, 2, 16), (6, 2, 32), (8, 2, 24), (3, 1, 16)],
    ids=["mha", "gqa3", "gqa4_d24", "mqa3"],
)
def test_attention_gqa_ratios_and_head_dims(Hq: int, Hkv: int, D: int) -> None:
    _check_attention(_parents("two_level"), 9, Hq, Hkv, D, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_causal_without_a_tree(dtype: torch.dtype) -> None:
    _check_attention(_parents("chain"), 6, 4, 2, 16, dtype, causal=True)


@pytest.mark.parametrize("num_splits", [1, 2, 3])
def test_attention_key_splits_and_blocks_agree(num_splits: int) -> None:
    """A long prefix over several key blocks, in one split or merged from several."""
    _check_attention(
        _parents("forest"), 41, 4, 2, 16, torch.float32, num_splits=num_splits, block_n=16
    )


def test_attention_reads_strided_views_in_place() -> None:
    """A head-major cache sliced to S keys and queries sliced from a wider projection."""
    parents = _parents("two_level")
    T, prefix_len, Hq, Hkv, D = len(parents), 10, 4, 2, 16
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(T, Hq, 2 * D, generator=gen)[..., :D]  # [T, Hq, D], stride(1) = 2D
    k_cache = torch.randn(Hkv, 32, D, generator=gen)  # [Hkv, max_len, D]
    v_cache = torch.randn(Hkv, 32, D, generator=gen)
    k = k_cache[:, : prefix_len + T].transpose(0, 1)  # [S, Hkv, D], not contiguous
    v = v_cache[:, : prefix_len + T].transpose(0, 1)
    args = (q, k, v, prefix_len, _ancestor_mask(parents), D**-0.5)

    out = triton_attention.tree_attention(*args)

    expected = reference.tree_attention(q.contiguous(), k.contiguous(), v.contiguous(), *args[3:])
    _assert_matches(out, expected, torch.float32)


def test_attention_without_prefix() -> None:
    _check_attention(_parents("random", seed=7), 0, 4, 1, 32, torch.float32)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_qwen36_head_shape(dtype: torch.dtype) -> None:
    """Qwen3.6-27B attention heads: 24 q / 4 kv heads of 256 (scaled down to 6 / 1)."""
    _check_attention(_parents("two_level"), 20, 6, 1, 256, dtype, num_splits=2, block_n=16)


# --- paged attention: block tables, several sequences a launch -------------------------------

PAGED_SEQUENCES = [(5, "two_level"), (0, "chain"), (13, "forest"), (9, "single")]  # prefix, tree


def _paged_inputs(sequences, Hq, Hkv, D, dtype, block_tokens=4, causal=False, seed=5):
    """q of every sequence concatenated, a pool whose blocks each sequence holds scattered
    (tables in a shuffled order, unused entries 0), and the other paged arguments."""
    gen = torch.Generator().manual_seed(seed)
    trees = [_parents(tree) for _, tree in sequences]
    lengths = [prefix + len(tree) for (prefix, _), tree in zip(sequences, trees, strict=True)]
    needed = [-(-n // block_tokens) for n in lengths]
    order = torch.randperm(sum(needed) + 3, generator=gen)  # 3 blocks no one holds
    table_len = max(needed) + 1
    tables = torch.zeros(len(sequences), table_len, dtype=torch.int64)
    taken = 0
    for b, count in enumerate(needed):
        tables[b, :count] = order[taken : taken + count]
        taken += count
    blocks = len(order)
    k = _randn(blocks, block_tokens, Hkv, D, dtype=dtype, gen=gen)
    v = _randn(blocks, block_tokens, Hkv, D, dtype=dtype, gen=gen)
    T = [len(tree) for tree in trees]
    q = _randn(sum(T), Hq, D, dtype=dtype, gen=gen)
    starts = torch.tensor([0, *torch.tensor(T).cumsum(0).tolist()])
    prefixes = torch.tensor([prefix for prefix, _ in sequences])
    visible = None
    if not causal:
        visible = torch.zeros(sum(T), max(T), dtype=torch.bool)
        for b, tree in enumerate(trees):
            visible[starts[b] : starts[b + 1], : T[b]] = _ancestor_mask(tree)
    return q, k, v, tables, starts, prefixes, visible


def _contiguous_expected(q, k, v, tables, starts, prefixes, visible, scale):
    """Each sequence alone through `reference.tree_attention` over its keys copied in order."""
    out, block_tokens = [], k.shape[1]
    for b, prefix in enumerate(prefixes.tolist()):
        rows = slice(int(starts[b]), int(starts[b + 1]))
        T = rows.stop - rows.start
        used = tables[b, : -(-(prefix + T) // block_tokens)]
        keys, values = k[used].flatten(0, 1), v[used].flatten(0, 1)
        mask = None if visible is None else visible[rows, :T]
        out.append(reference.tree_attention(q[rows], keys, values, prefix, mask, scale))
    return torch.cat(out)


def test_paged_reference_is_each_sequence_over_its_blocks() -> None:
    args = _paged_inputs(PAGED_SEQUENCES, 4, 2, 16, torch.float64)
    expected = _contiguous_expected(*args, 0.25)
    for impl in (reference, batched):
        _assert_matches(impl.paged_tree_attention(*args, 0.25), expected, torch.float64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_paged_attention_matches_reference_over_scattered_blocks(dtype: torch.dtype) -> None:
    args = _paged_inputs(PAGED_SEQUENCES, 4, 2, 16, dtype)
    out = triton_attention.paged_tree_attention(*args, 16**-0.5)
    _assert_matches(out, reference.paged_tree_attention(*args, 16**-0.5), dtype)


@pytest.mark.parametrize(("num_splits", "block_n", "block_tokens"), [(1, 16, 4), (3, 16, 8)])
def test_paged_attention_splits_and_blocks_of_other_sizes(num_splits, block_n, block_tokens):
    """Key splits merged, and key steps that span several blocks or a part of one."""
    sequences = [(41, "forest"), (3, "wide"), (20, "chain")]
    args = _paged_inputs(sequences, 6, 2, 16, torch.float32, block_tokens=block_tokens)
    out = triton_attention.paged_tree_attention(*args, 0.3, num_splits=num_splits, block_n=block_n)
    _assert_matches(out, reference.paged_tree_attention(*args, 0.3), torch.float32)


def test_paged_attention_causal_prefill_chunks() -> None:
    """Without a mask each sequence's queries are a causal chain (prefill chunks)."""
    sequences = [(7, "chain"), (0, "chain"), (2, "single")]
    args = _paged_inputs(sequences, 4, 1, 32, torch.float32, causal=True)
    out = triton_attention.paged_tree_attention(*args, 0.2)
    _assert_matches(out, reference.paged_tree_attention(*args, 0.2), torch.float32)


def test_one_paged_sequence_equals_the_contiguous_kernel() -> None:
    """A lone sequence over its block table gives what the contiguous kernel gives over the
    same keys in order (the engine's batch-1 pass either way)."""
    q, k, v, tables, starts, prefixes, visible = _paged_inputs(
        [(10, "two_level")], 4, 2, 16, torch.float32
    )
    expected = _contiguous_expected(q, k, v, tables, starts, prefixes, visible, 0.25)
    out = triton_attention.paged_tree_attention(q, k, v, tables, starts, prefixes, visible, 0.25)
    _assert_matches(out, expected, torch.float32)


# --- float64, empty trees, dispatch -----------------------------------------------------------


def test_float64_inputs_compute_in_float64() -> None:
    parents = _parents("forest")
    T = len(parents)
    q, k, v = _attention_inputs(T, 7, 4, 2, 16, torch.float64)
    args = (q, k, v, 7, _ancestor_mask(parents), 0.3)
    _assert_matches(
        triton_attention.tree_attention(*args), reference.tree_attention(*args), torch.float64
    )

    x, conv_state, weight, bias = _conv_inputs(T, 6, 3, 4, torch.float64)
    conv_args = (x, parents, conv_state, weight, bias)
    expected_conv = reference.tree_causal_conv1d(*conv_args)
    _assert_matches(triton_conv.tree_causal_conv1d(*conv_args), expected_conv, torch.float64)

    q, k, v, g, beta, state0 = _delta_inputs(T, 2, 16, 8, torch.float64)
    delta_args = (q, k, v, g, beta, parents, state0, 0.25)
    out, states = triton_gated_delta.tree_gated_delta_rule(*delta_args, return_states=True)
    expected_out, expected_states = reference.tree_gated_delta_rule(*delta_args, return_states=True)
    _assert_matches(out, expected_out, torch.float64)
    _assert_matches(states, expected_states, torch.float64)


def test_empty_trees_give_empty_outputs() -> None:
    no_parents = torch.empty(0, dtype=torch.int64)
    q, k, v = _attention_inputs(0, 3, 2, 1, 16, torch.float32)
    for impl in (triton_attention, reference, batched):
        assert impl.tree_attention(q, k, v, 3, None, 0.25).shape == (0, 2, 16)
        no_tree = torch.zeros(0, 0, dtype=torch.bool)
        assert impl.tree_attention(q, k, v, torch.tensor([3]), no_tree, 0.25).shape == (0, 2, 16)
    x, conv_state, weight, bias = _conv_inputs(0, 4, 3, 4, torch.float32)
    assert triton_conv.tree_causal_conv1d(x, no_parents, conv_state, weight, bias).shape == (0, 4)
    q, k, v, g, beta, state0 = _delta_inputs(0, 2, 16, 8, torch.float32)
    out, _ = triton_gated_delta.tree_gated_delta_rule(q, k, v, g, beta, no_parents, state0, 0.25)
    assert out.shape == (0, 2, 8)


def test_dispatch_keeps_cpu_tensors_off_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    """Even with the interpreter on, CPU tensors never reach a Triton kernel."""

    def refuse(*args, **kwargs):
        raise AssertionError("a Triton kernel was called with CPU tensors")

    for module, name in [
        (triton_attention, "tree_attention"),
        (triton_conv, "tree_causal_conv1d"),
        (triton_gated_delta, "tree_gated_delta_rule"),
    ]:
        monkeypatch.setattr(module, name, refuse)
    parents = _parents("wide")
    T = len(parents)
    q, k, v = _attention_inputs(T, 2, 2, 1, 16, torch.float32)
    att_args = (q, k, v, 2, _ancestor_mask(parents), 0.25)
    _assert_matches(
        kernels.tree_attention(*att_args), reference.tree_attention(*att_args), torch.float32
    )
    x, conv_state, weight, bias = _conv_inputs(T, 4, 3, 4, torch.float32)
    conv_args = (x, parents, conv_state, weight, bias)
    assert torch.equal(
        kernels.tree_causal_conv1d(*conv_args), reference.tree_causal_conv1d(*conv_args)
    )
    delta_args = (*_delta_inputs(T, 1, 16, 8, torch.float32)[:5], parents)
    state0 = torch.zeros(1, 16, 8)
    out, states = kernels.tree_gated_delta_rule(*delta_args, state0, 0.25, return_states=True)
    expected = reference.tree_gated_delta_rule(*delta_args, state0, 0.25, return_states=True)
    _assert_matches(out, expected[0], torch.float32)  # the batched form: another summation order
    _assert_matches(states, expected[1], torch.float32)


_ON_CUDA = SimpleNamespace(is_cuda=True)  # stands in for a CUDA tensor: only is_cuda is read
_ON_CPU = SimpleNamespace(is_cuda=False)


def test_backend_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(kernels.BACKEND_ENV, raising=False)
    assert kernels.backend_for(_ON_CUDA) == "triton"
    assert kernels.backend_for(_ON_CPU) == "batched"
    monkeypatch.setenv(kernels.BACKEND_ENV, "reference")
    assert kernels.backend_for(_ON_CUDA) == "reference"
    assert kernels.backend_for(_ON_CPU) == "reference"
    monkeypatch.setenv(kernels.BACKEND_ENV, "auto")
    monkeypatch.setattr(kernels, "_triton_importable", lambda: False)
    assert kernels.backend_for(_ON_CUDA) == "batched"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the behaviour without CUDA")
def test_gpu_check_without_cuda_says_so_and_runs_nothing(capsys: pytest.CaptureFixture) -> None:
    from engine.tools import gpu_check

    assert gpu_check.main([]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_backend_choice_rejects_unknown_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(kernels.BACKEND_ENV, "cuda")
    with pytest.raises(ValueError, match="DDOPS_KERNELS='cuda'"):
        kernels.backend_for(_ON_CUDA)


# --- attention: device-side prefix, launch choices that do not follow the context ------------


@pytest.mark.parametrize("num_splits", [1, 3])
def test_attention_reads_a_device_prefix_over_a_whole_cache(num_splits: int) -> None:
    """A preallocated cache and the committed length as a device tensor (a captured graph's
    inputs): keys past prefix + T are ignored, in every backend."""
    parents = _parents("two_level")
    T, prefix_len, Hq, Hkv, D = len(parents), 13, 4, 2, 16
    q, k, v = _attention_inputs(T, 40, Hq, Hkv, D, torch.float32)  # 40 + T slots
    visible = _ancestor_mask(parents)
    end = prefix_len + T
    expected = reference.tree_attention(q, k[:end], v[:end], prefix_len, visible, 0.25)
    length = torch.tensor([prefix_len])

    out = triton_attention.tree_attention(
        q, k, v, length, visible, 0.25, num_splits=num_splits, block_n=16
    )

    _assert_matches(out, expected, torch.float32)
    for impl in (reference, batched):
        _assert_matches(
            impl.tree_attention(q, k, v, length, visible, 0.25), expected, torch.float32
        )


class _LaunchRecorder:
    """Stands in for a Triton kernel: records each launch's grid, arguments and constexprs."""

    def __init__(self, kernel) -> None:
        self.names = list(inspect.signature(kernel.fn).parameters)
        self.launches: list[tuple[tuple, dict, dict]] = []

    def __getitem__(self, grid: tuple):
        def launch(*args, **constexprs) -> None:
            self.launches.append((grid, dict(zip(self.names, args, strict=False)), constexprs))

        return launch

    def varying_ints(self) -> set[str]:
        """The int arguments that took more than one value over the launches."""
        values: dict[str, set] = {}
        for _, args, _ in self.launches:
            for name, value in args.items():
                if isinstance(value, int):
                    values.setdefault(name, set()).add(value)
        return {name for name, seen in values.items() if len(seen) > 1}


@pytest.mark.parametrize("device_prefix", [True, False], ids=["whole_cache", "growing_slice"])
def test_attention_launches_one_specialisation_as_the_context_grows(
    monkeypatch: pytest.MonkeyPatch, device_prefix: bool
) -> None:
    """Only the arguments the kernel never specialises on change with the context; with a
    device prefix over a whole cache the grid stays too (one captured graph serves all)."""
    recorder = _LaunchRecorder(triton_attention._tree_attention_kernel)
    monkeypatch.setattr(triton_attention, "_tree_attention_kernel", recorder)
    merges = _LaunchRecorder(triton_attention._merge_splits_kernel)
    monkeypatch.setattr(triton_attention, "_merge_splits_kernel", merges)
    monkeypatch.setattr(triton_attention, "_device_facts", lambda device: (132, (9, 0)))
    parents = _parents("two_level")
    T, capacity = len(parents), 4096
    q, k, v = _attention_inputs(T, capacity - T, 24, 4, 256, torch.bfloat16)
    for prefix_len in range(0, capacity - T, 97):
        if device_prefix:
            prefix, keys, values = torch.tensor([prefix_len]), k, v
        else:
            prefix, keys, values = prefix_len, k[: prefix_len + T], v[: prefix_len + T]
        triton_attention.tree_attention(q, keys, values, prefix, _ancestor_mask(parents), 0.0625)

    constexprs = {tuple(sorted(c.items())) for _, _, c in recorder.launches}
    assert len(constexprs) == 1
    assert recorder.varying_ints() <= set(triton_attention.RUNTIME_ARGS)
    assert merges.varying_ints() <= {"rows", "num_splits"}
    grids = {grid for grid, _, _ in recorder.launches}
    assert len(grids) == 1 if device_prefix else len(grids) > 1


def test_compiled_attention_kernels_do_not_specialise_on_lengths() -> None:
    compiled = compiled_copy("engine.kernels.triton_attention")
    assert set(compiled._tree_attention_kernel.do_not_specialize) == set(compiled.RUNTIME_ARGS)
    assert set(compiled._merge_splits_kernel.do_not_specialize) == {"rows", "num_splits"}


def test_split_count_follows_the_key_buffer_and_the_gpu() -> None:
    choose = triton_attention.choose_num_splits
    # A verify round at Qwen3.6 shapes (96 rows: 2 row blocks of 64, 4 kv heads) on 132 SMs:
    # two programs an SM, whatever the context inside a 32k cache.
    assert choose(132, 2, 4, keys=32768, block_n=64) == 33
    assert choose(132, 2, 4, keys=1024, block_n=64) == 4  # at least 4 key blocks a split
    assert choose(132, 2, 4, keys=100, block_n=64) == 1
    assert choose(1, 2, 4, keys=32768, block_n=64) == 1  # the interpreter's single "SM"


# Shared memory a block may use: ~227 KB on A100 / H100 / H200 / B200, ~99 KB on the others.
_SHARED_MEMORY = {(9, 0): 227 * 1024, (8, 0): 163 * 1024, (12, 0): 99 * 1024, (8, 9): 99 * 1024}


@pytest.mark.parametrize("capability", list(_SHARED_MEMORY), ids=lambda c: f"sm_{c[0]}{c[1]}")
@pytest.mark.parametrize("rows", [6, 16, 96])
def test_attention_configs_fit_shared_memory_at_head_dim_256(capability, rows: int) -> None:
    """The query tile and num_stages K and V tiles of bf16 fit each GPU's shared memory."""
    cfg = triton_attention.attention_config(capability, 256, rows)
    tiles = cfg.block_m + 2 * cfg.num_stages * cfg.block_n
    assert tiles * 256 * 2 <= _SHARED_MEMORY[capability]
    assert cfg.num_stages >= 2  # loads of the next key block overlap the dots


def test_attention_configs_by_compute_capability() -> None:
    config = triton_attention.attention_config
    hopper, blackwell = config((9, 0), 256, 96), config((12, 0), 256, 96)
    assert (hopper.block_m, hopper.block_n, hopper.num_warps) == (64, 64, 8)
    assert (blackwell.block_m, blackwell.block_n, blackwell.num_warps) == (32, 32, 4)
    assert config(None, 256, 96) == blackwell  # unknown: the small-memory choice
    assert config((9, 0), 128, 6).block_n == config((12, 0), 128, 6).block_n == 64
    assert config((9, 0), 256, 6).block_m == 16  # a decode step's 6 rows
