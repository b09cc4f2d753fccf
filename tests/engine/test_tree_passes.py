"""A scheduler's tree steps by their bucket's static pass (engine/tree_passes.py), on the CPU.

What CUDA replays as one captured graph a bucket runs here eagerly, forced: each sequence still
equals its solo run (float64, dense and hybrid; every method, greedy and sampled, sequences
joining so the buckets pad, with preemptions and the prefix cache), padding nodes and rows
write no sequence's keys, and the pass compiles whole (`fullgraph=True`) and serves other trees
at other lengths without recompiling.

    python -m pytest -q tests/engine/test_tree_passes.py
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine import kv_blocks
from engine.models.common import Segment
from engine.step_passes import ALIGN, KeptArena, kv_of
from engine.tree_passes import TreePasses
from tests.helpers import batched_requests as batch
from tests.helpers.paged_attention import trees_attention
from tests.helpers.static_outputs import assert_same

pytestmark = pytest.mark.usefixtures("one_torch_thread", "fresh_dynamo")


@pytest.fixture
def pair(float64_pair):
    return float64_pair


def counted_trees(sched, monkeypatch) -> list[tuple[int, int, int]]:
    """Forces the tree steps' static passes on the scheduler; each tree step they run, as (its
    sequences, the bucket's trees, their width)."""
    sched.trees = TreePasses(sched.target, graphs=False, most=sched.max_num_seqs)
    steps: list[tuple[int, int, int]] = []
    filled = sched.trees.filled

    def filling(ids, parents, caches, layers):
        bucket = filled(ids, parents, caches, layers)
        steps.append((len(ids), *bucket.inputs.trees.visible.shape[:2]))
        return bucket

    monkeypatch.setattr(sched.trees, "filled", filling)
    return steps


def test_tree_steps_by_their_buckets_passes_equal_solo_runs(pair, monkeypatch):
    """Every method, greedy and sampled, three at first, then three more joining: the tree
    steps of three run in a bucket of four trees, those of six in one of six (the scheduler's
    slots: no wider), and trees narrower than the widest pad."""
    cases = list(
        zip(batch.prompts(pair, [5, 30, 9, 20, 12, 7], seed=3), batch.configs(), strict=True)
    )
    sched, got = batch.scheduler(pair, slots=6, tokens=64), batch.Collector()
    steps = counted_trees(sched, monkeypatch)
    for index, case in enumerate(cases):
        sched.add(got.request(index, *case))
        if index == 2:
            for _ in range(5):
                sched.step()
    batch.drain(sched)
    for index, (prompt, cfg) in enumerate(cases):
        assert got.output(index) == batch.solo(pair, prompt, cfg), batch.MIXED[index]
    assert (3, 4, 8) in steps or (3, 4, 16) in steps, steps
    assert any(count == 6 and trees == 6 and width == 16 for count, trees, width in steps), steps


def test_with_preemption_and_the_prefix_cache_outputs_equal_solo_runs(pair, monkeypatch):
    """Tree steps over a pool too small for every sequence at once (preemptions), beside a
    prefix cache of its blocks."""
    cases = list(
        zip(batch.prompts(pair, [5, 40, 9, 70, 3, 22], seed=9), batch.configs(), strict=True)
    )
    sched = batch.preempting_scheduler(pair)
    steps = counted_trees(sched, monkeypatch)
    batch.assert_solo_outputs(sched, pair, cases)
    assert sched.preemptions >= 1 and steps


def prefilled(pair, lengths: list[int]) -> list:
    """Caches holding random prompts and the blocks of a tree of 8 after them."""
    return batch.prefilled_caches(pair, lengths, room=8)


TREES = [  # (tokens, parents): a tree of 5, a chain of 3, a bonus alone
    ([5, 6, 7, 8, 9], [-1, 0, 0, 1, 1]),
    ([10, 11, 12], [-1, 0, 1]),
    ([13], [-1]),
]


def segments_of(caches: list, trees: list) -> tuple[list[np.ndarray], list[Segment]]:
    ids = [np.array(tokens) for tokens, _ in trees]
    segments = [
        Segment(torch.tensor(tokens), cache, torch.tensor(parents))
        for (tokens, parents), cache in zip(trees, caches, strict=True)
    ]
    return ids, segments


def test_padding_nodes_and_rows_store_keys_in_the_padding_block_alone(pair):
    """A step of three trees (5, 3 and 1 nodes) in a bucket of four trees of 8: the pool
    changes only at the sequences' pending slots and in the padding block."""
    caches = prefilled(pair, [9, 14, 5])
    kv = [kv_of(cache) for cache in caches]
    pool = kv[0].pool
    padding = pool.padding_block()
    before = pool.k.clone()
    passes = TreePasses(pair[0], graphs=False)
    ids, segments = segments_of(caches, TREES)
    assert passes.takes(segments)
    passes.run(ids, segments, ())
    changed = (pool.k != before).flatten(3).any(-1).any(0).nonzero().tolist()  # (block, slot)
    block = pool.block_tokens
    pending = {
        (c.blocks[slot // block], slot % block)
        for c, tokens in zip(kv, ids, strict=True)
        for slot in range(c.length, c.length + len(tokens))
    }
    assert {tuple(at) for at in changed if at[0] != padding} == pending
    assert any(at[0] == padding for at in changed)  # the padding nodes' and row's keys


@pytest.mark.parametrize("order", [[0, 1, 2], [2, 0]], ids=["all", "two-reordered"])
def test_a_step_commits_as_the_eager_batched_pass_does(pair, order):
    """The static step's logits and commit (its K/V moved, its GDN states built by its commit
    pass from what it kept) equal `forward_batch`'s and `commit_batch`'s on copies of the same
    caches, whichever of its sequences commit in whatever order."""
    target = pair[0]
    got, want = prefilled(pair, [9, 14, 5]), prefilled(pair, [9, 14, 5])
    ids, segments = segments_of(got, TREES)
    outputs = TreePasses(target, graphs=False).run(ids, segments, ())
    _, eager = segments_of(want, TREES)
    expected = target.forward_batch(eager, ())
    for mine, theirs in zip(outputs.logits, expected.logits, strict=True):
        torch.testing.assert_close(mine, theirs)
    paths = [[0, 2], [0, 1, 2], [0]]
    outputs.commit([(got[i], paths[i]) for i in order])
    target.commit_batch([(want[i], paths[i]) for i in order])
    for mine, theirs in zip(got, want, strict=True):
        assert kv_of(mine).length == kv_of(theirs).length
        torch.testing.assert_close(committed(mine), committed(theirs))


def test_a_path_off_its_tree_is_refused(pair):
    caches = prefilled(pair, [9, 14, 5])
    ids, segments = segments_of(caches, TREES)
    outputs = TreePasses(pair[0], graphs=False).run(ids, segments, ())
    with pytest.raises(ValueError):
        outputs.commit([(caches[0], [0, 1, 2])])  # node 2's parent is the root, not node 1


def committed(cache) -> list[torch.Tensor]:
    """A cache's committed K/V and GDN states."""
    kv = kv_of(cache)
    keys = [kv.read(0, kv.length)]
    states = getattr(cache, "recurrent", [])
    return keys + [part for state in states for part in (state.conv, state.recurrent)]


def test_a_tree_step_compiles_as_one_graph_and_serves_other_trees(pair, monkeypatch):
    """The bucket's verify and (a hybrid target's) commit passes compile whole, match eager,
    and run other sequences' trees (other slots, lengths, tokens, shapes and paths) from the
    same buffers without recompiling."""
    target, drafter = pair
    monkeypatch.setattr(kv_blocks, "paged_tree_attention", trees_attention)
    caches = prefilled(pair, [9, 14, 5, 20])
    passes, layers = TreePasses(target, graphs=False), drafter.target_layer_ids
    ends = [(0, 3), (1, 2), (2, 0)]
    first = filled(passes, caches[:3], TREES, layers, ends)
    first.verify.run()  # (a hybrid target's factors size the kept arena: passes made again)
    bucket = filled(passes, caches[:3], TREES, layers, ends)
    assert (bucket is first) == (bucket.commit is None)
    verify = torch.compile(bucket.verify.run, fullgraph=True, backend="eager")
    commit = bucket.commit and torch.compile(bucket.commit.run, fullgraph=True, backend="eager")
    assert (commit is None) == (not hasattr(target, "commit_trees"))  # a dense one has none
    want = bucket.verify.run()
    assert_same(verify(), want)
    check_commit(bucket, commit, want)
    trees = [TREES[1], ([20, 21, 22, 23, 24, 25], [-1, 0, 1, 2, 0, 4]), TREES[2]]
    others = [caches[3], caches[0], caches[2]]
    again = filled(passes, others, trees, layers, [(1, 5), (0, 2)])
    assert again is bucket
    with torch.compiler.set_stance("fail_on_recompile"):
        got = verify()
        assert_same(got, bucket.verify.run())
        check_commit(bucket, commit, got)


def filled(passes: TreePasses, caches: list, trees: list, layers, ends: list):
    """`passes.filled` with `trees` on `caches`, its commit's ends (tree row, last node)."""
    ids, segments = segments_of(caches, trees)
    parents = [np.array(p) for _, p in trees]
    bucket = passes.filled(ids, parents, caches, layers)
    if bucket.commit is not None:
        bucket.fill_ends([(row, last, caches[row]) for row, last in ends])
    return bucket


def check_commit(bucket, compiled, verified) -> None:
    """The compiled commit of what `verified` kept writes the states the eager one does."""
    if compiled is None:
        return
    bucket.kept[:] = [verified[2]]
    parts = [part for rows in bucket.inputs.slots for part in (rows.conv, rows.recurrent)]
    before = [part.clone() for part in parts]
    bucket.commit.run()
    want = [part.clone() for part in parts]
    for part, saved in zip(parts, before, strict=True):
        part.copy_(saved)
    compiled()
    assert_same(parts, want)
    assert any(not torch.equal(now, then) for now, then in zip(parts, before, strict=True))


def test_a_kept_arena_lays_every_pass_over_the_same_memory_and_grows_by_doubling():
    """A first pass grows it (the run before a capture); the next ones lay their copies over
    the same memory, each aligned; a larger pass doubles it."""
    arena = KeptArena(torch.device("cpu"))
    small, wide = torch.arange(3.0), torch.ones(2, 2, dtype=torch.float64)
    arena.begin()
    arena.hold((small, wide))
    arena.begin()
    held = arena.hold((small, wide))
    assert torch.equal(held[0], small) and torch.equal(held[1], wide)
    assert held[1].data_ptr() - held[0].data_ptr() == ALIGN
    grown = arena.generation
    arena.begin()
    again = arena.hold((small * 2, wide))
    assert arena.generation == grown and again[0].data_ptr() == held[0].data_ptr()
    size = arena.storage.numel()
    arena.begin()
    arena.hold((torch.zeros(size // 8 + 1, dtype=torch.float64),))
    assert arena.generation == grown + 1 and arena.storage.numel() == 2 * size
