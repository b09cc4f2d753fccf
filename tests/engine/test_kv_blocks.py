"""Paged KV (engine/kv_blocks.py): the block pool's counts and copy on write, and every model
decoding on block tables exactly as on contiguous caches.

    python -m pytest -q tests/engine/test_kv_blocks.py

The models are the tiny random dense and hybrid pairs in float64, with blocks of 4 tokens so a
few dozen tokens cross many blocks; a pool some of whose blocks another holder keeps leaves the
sequence's blocks out of order, so attention reads them through the table, not as one slice.
"""

from __future__ import annotations

import pytest
import torch

from engine.cache_pool import CachePool
from engine.decode import GenerationConfig, generate
from engine.kernels.batched import ancestor_matrix
from engine.kv_blocks import KVBlockPool, KVLayout, PagedKVCache, PoolExhausted, commit_paths
from engine.memory_plan import is_out_of_memory
from tests.helpers.tiny_pairs import KINDS, load_tiny_pair

BLOCK = 4
PROMPT = [5, 9, 14, 3, 3, 27, 8, 11, 40, 2, 19, 31, 7, 22, 60, 13, 44, 45]
CASES = [("ar", 1), ("linear", 1), ("ddtree", 6)]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def layout(layers: int = 2) -> KVLayout:
    return KVLayout(layers, 1, 2, torch.float64, torch.device("cpu"))


def test_blocks_are_counted_shared_and_freed_lowest_first() -> None:
    pool = KVBlockPool(layout(), capacity=3, block_tokens=BLOCK)
    first, second = pool.allocate(), pool.allocate()
    assert (first, second) == (0, 1)
    pool.share(first)
    pool.release(first)
    assert pool.refs[first] == 1  # still held once
    pool.release(first)
    assert pool.allocate() == 0  # freed, and the lowest again
    with pytest.raises(ValueError, match="released more often"):
        pool.release(2)
    with pytest.raises(ValueError, match="free"):
        pool.share(2)


def test_an_exhausted_pool_asks_the_prefix_cache_then_runs_out_of_memory() -> None:
    pool = KVBlockPool(layout(), capacity=2, block_tokens=BLOCK)
    held = [pool.allocate(), pool.allocate()]
    asked = []

    def reclaim() -> bool:  # lets go of one block, once
        asked.append(True)
        if len(asked) == 1:
            pool.release(held.pop())
            return True
        return False

    pool.reclaim = reclaim
    assert pool.allocate() == 1
    with pytest.raises(PoolExhausted) as error:
        pool.allocate()
    assert len(asked) == 2
    assert is_out_of_memory(error.value)  # the server's out-of-memory answer, not a 500


def test_the_pool_grows_on_the_cpu_keeping_its_blocks() -> None:
    pool = KVBlockPool(layout(), capacity=9, block_tokens=BLOCK)
    assert pool.k.shape[1] < 9  # nothing allocated up front beyond a few blocks
    blocks = [pool.allocate() for _ in range(9)]
    assert blocks == list(range(9)) and pool.k.shape[1] == 9
    cache = PagedKVCache(pool, 8)
    with pytest.raises(PoolExhausted):
        cache.check_room(1)


def _filled(cache: PagedKVCache, count: int) -> torch.Tensor:
    """Write `count` distinct K/V rows at slots 0.. and commit them; the values written."""
    values = torch.arange(count * 2, dtype=torch.float64).view(count, 1, 2) + 1
    cache.check_room(count)
    for layer in range(2):
        cache.store(layer, 0, values, -values)
    cache.advance(count)
    return values


def test_a_shared_tail_block_is_copied_before_it_is_written() -> None:
    pool = KVBlockPool(layout(), capacity=8, block_tokens=BLOCK)
    owner = PagedKVCache(pool, 16)
    values = _filled(owner, 6)  # one whole block and a tail of 2
    reader = PagedKVCache(pool, 16)
    reader.adopt(owner.blocks, 6)
    assert reader.blocks == owner.blocks  # shared, nothing copied
    assert [pool.refs[b] for b in owner.blocks] == [2, 2]

    reader.check_room(3)  # its next pass writes slots 6..8: into the tail block
    assert reader.blocks[0] == owner.blocks[0]  # the whole block stays shared
    assert reader.blocks[1] != owner.blocks[1]  # the tail is the reader's own copy
    new = torch.full((3, 1, 2), 99.0, dtype=torch.float64)
    reader.store(0, 6, new, new)
    torch.testing.assert_close(owner.keys(0, 6)[0], values)  # the owner's tokens unchanged
    torch.testing.assert_close(reader.keys(0, 9)[0], torch.cat([values, new]))

    owner.reset()
    reader.reset()
    assert pool.free_blocks == 8  # every block back


def test_commit_gathers_the_accepted_pending_slots_across_blocks() -> None:
    pool = KVBlockPool(layout(), capacity=8, block_tokens=BLOCK)
    pool.allocate()  # someone else's block: the cache's blocks are 1, 2, 3, not in order
    cache = PagedKVCache(pool, 12)
    _filled(cache, 3)
    pending = torch.arange(6, dtype=torch.float64).view(6, 1, 1).expand(6, 1, 2) + 100
    cache.check_room(6)
    for layer in range(2):
        cache.store(layer, 3, pending, pending)
    cache.commit(torch.tensor([0, 2, 5]))
    assert cache.length == 6
    kept = cache.keys(1, 6)[1][3:, 0, 0]
    assert kept.tolist() == [100.0, 102.0, 105.0]
    saved = cache.read(2, 5)
    other = PagedKVCache(pool, 12)
    other.check_room(5)
    other.place(2, saved)
    torch.testing.assert_close(other.read(2, 5), saved)


def test_paths_of_one_pools_sequences_commit_in_one_move_as_each_alone() -> None:
    """`commit_paths` (a batched pass's): an ar step's path stays in place, the trees' move
    in one gather and one scatter; every sequence's K/V as its own `commit` leaves it."""
    paths = [[0], [0, 2, 5], [0, 1, 3], [0, 1]]
    together, alone = KVBlockPool(layout(), 16, BLOCK), KVBlockPool(layout(), 16, BLOCK)
    caches = [[PagedKVCache(pool, 16) for _ in paths] for pool in (together, alone)]
    for index in range(len(paths)):  # the pools' blocks interleaved, alike in both
        for pool_caches in caches:
            cache = pool_caches[index]
            _filled(cache, 3 + index)
            pending = torch.arange(6, dtype=torch.float64).view(6, 1, 1).expand(6, 1, 2)
            cache.check_room(6)
            for layer in range(2):
                cache.store(layer, cache.length, pending + 10 * index, pending - index)
    moved = []
    together.move = lambda sources, targets: (
        moved.append(len(sources)) or KVBlockPool.move(together, sources, targets)
    )

    commit_paths(caches[0], paths)
    for cache, path in zip(caches[1], paths, strict=True):
        cache.commit(torch.tensor(path))

    assert moved == [3]  # 2 + 1 slots moved: nodes already in place are left
    for mine, theirs in zip(*caches, strict=True):
        assert mine.length == theirs.length
        for layer in range(2):
            for got, expected in zip(
                mine.keys(layer, mine.length), theirs.keys(layer, mine.length), strict=True
            ):
                assert torch.equal(got, expected)


@pytest.fixture(scope="module", params=KINDS)
def pair(request, tmp_path_factory):
    return load_tiny_pair(
        tmp_path_factory.mktemp(request.param), request.param, dtype=torch.float64
    )


def _paged_pool(pair, max_len: int, scattered: bool) -> CachePool:
    """A pool on block tables of BLOCK tokens; `scattered`: every other block held elsewhere,
    so a sequence's blocks are never in order."""
    target, drafter = pair
    spare = max_len // BLOCK + 2
    pool = CachePool(target, drafter, max_len, block_tokens=BLOCK, spare_blocks=spare)
    assert pool.target_blocks is not None and pool.draft_blocks is not None
    if scattered:
        for blocks in (pool.target_blocks, pool.draft_blocks):
            held = [blocks.allocate() for _ in range(2 * (spare - 1))]
            for block in held[1::2]:
                blocks.release(block)
    return pool


@pytest.mark.parametrize("scattered", [False, True], ids=["in-order", "scattered"])
@pytest.mark.parametrize(("method", "budget"), CASES)
def test_generation_on_block_tables_equals_contiguous_caches(pair, method, budget, scattered):
    """Tokens and every round's tree identical, target and drafter both on block tables."""
    target, drafter = pair
    cfg = GenerationConfig(method, budget, max_new_tokens=14, prefill_chunk=5, trace=True)
    max_len = len(PROMPT) + 14 + 16
    contiguous = CachePool(target, drafter, max_len, paged=False)
    assert contiguous.target_blocks is None
    want = generate(target, drafter, PROMPT, cfg, pool=contiguous)
    paged = _paged_pool(pair, max_len, scattered)
    got = generate(target, drafter, PROMPT, cfg, pool=paged)
    blocks = getattr(paged.cache, "kv", paged.cache).blocks
    in_order = blocks == list(range(blocks[0], blocks[0] + len(blocks)))
    assert in_order != scattered  # the layout this case is about
    assert got.output_ids == want.output_ids
    assert got.rounds == want.rounds
    assert got.acceptance_lengths == want.acceptance_lengths


def test_model_passes_on_block_tables_give_identical_float64_logits(pair) -> None:
    """The target's prefill chunk, tree pass and commit, and the drafter's draft, bit for bit."""
    target, drafter = pair
    pool = _paged_pool(pair, 64, scattered=True)
    caches = [
        (target.new_cache(64), drafter.new_cache(64)),
        (pool.cache, pool.draft_cache),
    ]
    ids = torch.tensor(PROMPT)
    tree = torch.tensor([-1, 0, 0, 1, -1])
    outputs = []
    for cache, draft_cache in caches:
        layers = tuple(drafter.target_layer_ids)
        prefill, hidden = target.extend(ids[:11], cache, layers)
        more, hidden_more = target.extend(ids[11:], cache, layers)
        logits, tree_hidden = target.forward(ids[:5], cache, tree, layers)
        target.commit(cache, torch.tensor([0, 1, 3]))
        after, _ = target.forward(ids[5:8], cache, None)
        context = torch.cat([hidden, hidden_more])
        draft = drafter.draft(target, draft_cache, context, bonus=7)
        draft_again = drafter.draft(target, draft_cache, tree_hidden[[0, 1, 3]], bonus=9)
        outputs.append([prefill, more, logits, after, draft, draft_again])
    for paged, contiguous in zip(outputs[1], outputs[0], strict=True):
        assert torch.equal(paged, contiguous)


def test_the_paged_kernel_s_arguments_decode_the_same(pair, monkeypatch) -> None:
    """The path CUDA takes (one sequence's table, lengths and mask through
    kernels.paged_tree_attention), run here by its CPU implementation: the same tokens."""
    from engine import kv_blocks

    target, drafter = pair
    cfg = GenerationConfig("ddtree", 6, max_new_tokens=10, prefill_chunk=5, trace=True)
    max_len = len(PROMPT) + 10 + 16
    want = generate(
        target, drafter, PROMPT, cfg, pool=CachePool(target, drafter, max_len, paged=False)
    )
    calls = []
    paged = kv_blocks.paged_tree_attention

    def counted(*args):
        calls.append(args[3].shape)
        return paged(*args)

    monkeypatch.setattr(kv_blocks, "reads_blocks_in_place", lambda q: True)
    monkeypatch.setattr(kv_blocks, "paged_tree_attention", counted)
    got = generate(target, drafter, PROMPT, cfg, pool=_paged_pool(pair, max_len, scattered=True))
    assert calls and all(shape[0] == 1 for shape in calls)  # one sequence a call
    assert got.output_ids == want.output_ids and got.rounds == want.rounds


def _interleaved_sequences(pending: list[int], trees: list, lengths=(7, 2, 13)):
    """Three sequences over one pool, committed in turns (their blocks interleave), with
    `pending` tokens each (a `trees` entry: its parents, None = causal) stored after them:
    (caches, queries, each one's rows, each one's [T, T] mask, the pending k and v rows)."""
    gen = torch.Generator().manual_seed(3)
    pool = KVBlockPool(layout(), capacity=24, block_tokens=BLOCK)
    caches = [PagedKVCache(pool, 40) for _ in range(3)]
    for step in range(3):
        for cache, length in zip(caches, lengths, strict=True):
            count = length // 3 + (step < length % 3)
            cache.check_room(count)
            for layer in range(2):
                kv = torch.randn(count, 1, 2, generator=gen, dtype=torch.float64)
                cache.store(layer, cache.length, kv, -kv)
            cache.advance(count)
    q = torch.randn(sum(pending), 2, 2, generator=gen, dtype=torch.float64)
    k, v = torch.randn(2, 2, sum(pending), 1, 2, generator=gen, dtype=torch.float64)
    rows, start = [], 0
    for count in pending:
        rows.append(slice(start, start + count))
        start += count
    visible = []
    for cache, r, tree in zip(caches, rows, trees, strict=True):
        cache.check_room(r.stop - r.start)
        for layer in range(2):
            cache.store(layer, cache.length, k[layer, r], v[layer, r])
        visible.append(None if tree is None else ancestor_matrix(tree))
    first = caches[0].blocks
    assert first != list(range(first[0], first[0] + len(first)))  # interleaved with the others'
    return caches, q, rows, visible, k, v


def _each_alone(caches, layer: int, q, rows, visible) -> torch.Tensor:
    return torch.cat(
        [
            cache.attend(layer, q[r], cache.length, seen, 0.5, cache.length + r.stop - r.start)
            for cache, r, seen in zip(caches, rows, visible, strict=True)
        ]
    )


def test_sequences_attended_together_equal_each_alone() -> None:
    """A tree, a causal chunk and a single token in one paged launch (`PagedSequences`: made
    once for every layer) store their pending K/V where each cache's own store puts them and
    give what each cache's own attend gives."""
    from engine.kv_blocks import PagedSequences

    trees = [torch.tensor([-1, 0, 0, 1]), None, torch.tensor([-1])]
    caches, q, rows, visible, k, v = _interleaved_sequences([4, 5, 1], trees)
    pool = caches[0].pool
    stored = [flat.clone() for layer in range(2) for flat in pool.flat(layer)]
    launch = PagedSequences.of(caches, rows, visible)
    for layer in range(2):
        together = launch.attend(pool, layer, q, k[layer], v[layer], 0.5)
        assert torch.equal(together, _each_alone(caches, layer, q, rows, visible))
    after = [flat for layer in range(2) for flat in pool.flat(layer)]
    assert all(torch.equal(a, b) for a, b in zip(stored, after, strict=True))
    with pytest.raises(ValueError, match="in order"):
        PagedSequences.of(caches, rows[::-1], visible[::-1])


def test_padded_sequences_attend_as_each_alone() -> None:
    """Two trees and a causal chain of four tokens each, over 7, 2 and 13 committed ones: the
    padded batch (its keys gathered, the shorter ones' padding masked) stores their pending K/V
    where each cache's own store puts them and attends as each cache's own attend."""
    from engine.kv_blocks import PaddedSequences

    trees = [torch.tensor([-1, 0, 0, 1]), torch.tensor([-1, 0, 1, 0]), None]
    caches, q, rows, visible, k, v = _interleaved_sequences([4, 4, 4], trees)
    pool = caches[0].pool
    stored = [flat.clone() for layer in range(2) for flat in pool.flat(layer)]
    batch = PaddedSequences.of(caches, rows, visible, torch.float64)
    assert batch.shape == (3, 4, 17)
    for layer in range(2):
        together = batch.attend(pool, layer, q, k[layer], v[layer], 0.5)
        torch.testing.assert_close(together, _each_alone(caches, layer, q, rows, visible))
    after = [flat for layer in range(2) for flat in pool.flat(layer)]
    assert all(torch.equal(a, b) for a, b in zip(stored, after, strict=True))


def test_a_pool_limited_below_its_sequences_gives_back_storage_and_runs_out() -> None:
    pool = KVBlockPool(layout(), capacity=9, block_tokens=BLOCK)
    assert pool.k.shape[1] == 4  # the CPU's storage made ahead
    pool.limit(2)  # an oversubscribed pool (engine/scheduler.py preempts)
    assert pool.k.shape[1] == 2 and pool.free_blocks == 2
    assert [pool.allocate(), pool.allocate()] == [0, 1]
    with pytest.raises(PoolExhausted):
        pool.allocate()
    with pytest.raises(ValueError, match="in use"):
        pool.limit(1)
