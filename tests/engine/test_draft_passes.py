"""A scheduler's drafts by their bucket's static pass (engine/draft_passes.py), on the CPU.

What CUDA replays as one captured graph a bucket runs here eagerly, forced: its drafts and the
caches it leaves equal `draft_batch`'s, padding rows and sequences write only the padding
block, a scheduler with every step static (plain, tree and draft passes) still gives each
sequence its solo run (float64, dense and hybrid), and the pass compiles whole and serves other
sequences' drafts without recompiling.

    python -m pytest -q tests/engine/test_draft_passes.py
"""

from __future__ import annotations

import pytest
import torch

from engine import kv_blocks
from engine.cache_pool import CachePool
from engine.draft_passes import DraftPasses
from engine.step_passes import StepPasses
from engine.tree_passes import TreePasses
from tests.helpers import batched_requests as batch
from tests.helpers.paged_attention import trees_attention
from tests.helpers.static_outputs import assert_same

pytestmark = pytest.mark.usefixtures("one_torch_thread", "fresh_dynamo")


@pytest.fixture
def pair(float64_pair):
    return float64_pair


def draft_items(pair, lengths: list[int], rows: list[int], seed: int = 5) -> list:
    """Draft caches of one pool, each holding `lengths[i]` committed tokens' K/V, with a
    context of `rows[i]` random features and a bonus: the items a step drafts."""
    target, drafter = pair
    slots = CachePool(target, drafter, 96).slots(len(lengths))
    generator = torch.Generator().manual_seed(seed)
    width = drafter.fc.weight.shape[1]
    items = []
    for slot, length, count in zip(slots, lengths, rows, strict=True):
        cache = slot.draft_cache
        prompt = torch.randn(length, width, generator=generator, dtype=torch.float64)
        drafter.append_context(cache, prompt)
        context = torch.randn(count, width, generator=generator, dtype=torch.float64)
        items.append((cache, context, int(torch.randint(3, 60, (), generator=generator))))
    items[0][0].pool.padding_block()
    return items


def test_static_drafts_equal_the_batched_pass_and_leave_the_same_caches(pair):
    """Three drafts (contexts of 5, 1 and 3 rows) in a bucket of four sequences of 8 rows."""
    target, drafter = pair
    got, want = draft_items(pair, [9, 20, 4], [5, 1, 3]), draft_items(pair, [9, 20, 4], [5, 1, 3])
    passes = DraftPasses(drafter, target, graphs=False)
    assert passes.takes(got)
    drafts = passes.run(got)
    torch.testing.assert_close(drafts, drafter.draft_batch(target, want))
    B = drafter.block_size
    for (mine, _, _), (theirs, _, _) in zip(got, want, strict=True):
        assert mine.length == theirs.length
        torch.testing.assert_close(mine.read(0, mine.length + B), theirs.read(0, theirs.length + B))


def test_padding_rows_and_sequences_store_keys_in_the_padding_block_alone(pair):
    target, drafter = pair
    items = draft_items(pair, [9, 20, 4], [5, 1, 3])
    pool = items[0][0].pool
    padding, block, B = pool.padding_block(), pool.block_tokens, drafter.block_size
    expected = {
        (cache.blocks[slot // block], slot % block)
        for cache, context, _ in items
        for slot in range(cache.length, cache.length + context.shape[0] + B)
    }
    before = pool.k.clone()
    DraftPasses(drafter, target, graphs=False).run(items)
    changed = (pool.k != before).flatten(3).any(-1).any(0).nonzero().tolist()  # (block, slot)
    assert {tuple(at) for at in changed if at[0] != padding} == expected
    assert any(at[0] == padding for at in changed)


def test_a_long_context_drafts_eagerly(pair):
    """A context past MAX_CONTEXT rows (a prompt's, after its prefill) is not taken."""
    passes = DraftPasses(pair[1], pair[0], graphs=False)
    assert passes.takes(draft_items(pair, [4, 4], [64, 2]))
    assert not passes.takes(draft_items(pair, [4, 4], [65, 2]))


def test_every_step_static_outputs_equal_solo_runs(pair):
    """Plain, tree and draft steps all by their buckets' passes, as on CUDA: every method,
    greedy and sampled, three at first, then three more joining, over a pool too small for all
    (preemptions) beside a prefix cache."""
    cases = list(
        zip(batch.prompts(pair, [5, 40, 9, 30, 3, 22], seed=4), batch.configs(), strict=True)
    )
    sched = batch.preempting_scheduler(pair)
    target, drafter = pair
    sched.steps = StepPasses(target, graphs=False)
    sched.trees = TreePasses(target, graphs=False)
    sched.drafts = DraftPasses(drafter, target, graphs=False, most=sched.max_num_seqs)
    ran = []
    run = sched.drafts.run
    sched.drafts.run = lambda items: ran.append(len(items)) or run(items)
    got = batch.Collector()
    for index, case in enumerate(cases):
        sched.add(got.request(index, *case))
        if index == 2:
            for _ in range(5):
                sched.step()
    batch.drain(sched, limit=3000)
    for index, (prompt, cfg) in enumerate(cases):
        assert got.output(index) == batch.solo(pair, prompt, cfg), batch.MIXED[index]
    assert sched.preemptions >= 1 and max(ran) >= 3


def test_a_draft_compiles_as_one_graph_and_serves_other_sequences(pair, monkeypatch):
    """The bucket's pass compiles whole, matches eager, and drafts other sequences (other
    caches, lengths, contexts and bonuses) from the same buffers without recompiling."""
    target, drafter = pair
    monkeypatch.setattr(kv_blocks, "paged_tree_attention", trees_attention)
    items = draft_items(pair, [9, 20, 4, 11], [5, 1, 3, 2])
    passes = DraftPasses(drafter, target, graphs=False)
    step = passes.filled(items[:3])
    want = step.run()  # (eager first: the pool's views are made)
    compiled = torch.compile(step.run, fullgraph=True, backend="eager")
    assert_same(compiled(), want)
    again = passes.filled([items[3], items[0], items[1]])
    assert again is step
    with torch.compiler.set_stance("fail_on_recompile"):
        got = compiled()
    assert_same(got, step.run())
