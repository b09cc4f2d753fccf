"""The static passes a CUDA graph captures are graph-safe, proven on the CPU (engine/decode.py).

`torch.compile(fullgraph=True, backend="eager")` raises on a graph break: a host read
(`.item()`, `.tolist()`, `.cpu()`), a data-dependent Python branch, anything a CUDA graph could
not replay. Each pass (the ar step, the verify, the drafter's block) of the dense and the hybrid
target and of the DFlash drafter is compiled that way, run, compared with its eager self, then
run again at another committed length and another tree inside the same key window with
recompiling forbidden: the lengths and the tree are read from device buffers, not baked in.

Run: python -m pytest -q tests/engine/test_graph_safe.py
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.models.common import key_window
from engine.models.dflash import DraftInputs
from engine.tree import pack_pass, packed_size, unpack_pass
from tests.helpers.static_outputs import assert_same
from tests.helpers.tiny_pairs import KINDS, load_tiny_pair

MAX_LEN = 64
TREE = np.array([-1, 0, 0, 1, 2, 4])  # verify parents: two branches below the root
OTHER_TREE = np.array([-1, 0, 1, 2, 3, 4])  # a chain of the same width


@pytest.fixture(scope="module", params=KINDS)
def pair(request, tmp_path_factory):
    return load_tiny_pair(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def prefilled(target, length: int, seed: int = 0):
    ids = torch.randint(3, 90, (length,), generator=torch.Generator().manual_seed(seed))
    cache = target.new_cache(MAX_LEN)
    target.extend(ids, cache)
    return cache


def fill(buffer: torch.Tensor, parents: np.ndarray, length: int, seed: int) -> None:
    ids = np.random.default_rng(seed).integers(3, 90, len(parents))
    buffer.copy_(torch.from_numpy(pack_pass(ids, parents, length)))


def check_target_pass(target, layers, parents: np.ndarray, other: np.ndarray) -> None:
    """forward_static compiles whole, matches eager, and serves a second length and tree
    inside the same key window without recompiling."""
    width = len(parents)
    buffer = torch.zeros(packed_size(width), dtype=torch.long)
    inputs = unpack_pass(buffer, width)
    cache = prefilled(target, 9)
    keys = key_window(cache.length + width + 3, MAX_LEN)

    def run():
        return target.forward_static(inputs, cache, keys, layers)

    compiled = torch.compile(run, fullgraph=True, backend="eager")
    for length, tree, seed in ((9, parents, 0), (12, other, 1)):
        fill(buffer, tree, length, seed)
        with torch.compiler.set_stance("fail_on_recompile" if seed else "default"):
            got = compiled()
        assert_same(got, run())


def test_ar_step_compiles_as_one_graph(pair):
    target, _ = pair
    check_target_pass(target, (), np.array([-1]), np.array([-1]))


def test_verify_compiles_as_one_graph(pair):
    target, drafter = pair
    check_target_pass(target, drafter.target_layer_ids, TREE, OTHER_TREE)


def test_drafter_block_compiles_as_one_graph(pair):
    target, drafter = pair
    width, features = 6, len(drafter.target_layer_ids) * target.config.hidden_size
    cache = drafter.new_cache(MAX_LEN)
    drafter.draft(target, cache, torch.randn(7, features), bonus=5)  # a prompt's context
    context = torch.zeros(width, features)
    scalars = torch.zeros(3, dtype=torch.long)
    inputs = DraftInputs(context, *scalars)
    keys = key_window(cache.length + width + drafter.block_size + 4, cache.max_len)

    def run():
        return drafter.draft_static(target, cache, inputs, keys)

    compiled = torch.compile(run, fullgraph=True, backend="eager")
    for count, seed in ((3, 0), (6, 1)):
        context.copy_(torch.randn(width, features, generator=torch.Generator().manual_seed(seed)))
        scalars.copy_(torch.tensor([cache.length, count, 7 + seed]))
        with torch.compiler.set_stance("fail_on_recompile" if seed else "default"):
            got = compiled()
        assert_same(got, run())
        cache.length += count


def test_static_draft_equals_the_growing_one(pair):
    """The padded static block gives the logits `draft` gives for the same real context."""
    target, drafter = pair
    features = len(drafter.target_layer_ids) * target.config.hidden_size
    prompt, fresh = torch.randn(7, features), torch.randn(3, features)
    growing, static = drafter.new_cache(MAX_LEN), drafter.new_cache(MAX_LEN)
    for cache in (growing, static):
        drafter.draft(target, cache, prompt, bonus=5)
    want = drafter.draft(target, growing, fresh, bonus=9)
    context = torch.zeros(6, features)
    context[:3] = fresh
    inputs = DraftInputs(context, *torch.tensor([static.length, 3, 9]))
    got = drafter.draft_static(target, static, inputs, key_window(40, static.max_len))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
