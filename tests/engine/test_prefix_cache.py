"""The prefix cache (engine/prefix_cache.py, engine/cache_pool.py): whole conversations decode the
same tokens with the cache on and off, and reuse what they should.

    python -m pytest -q tests/engine/test_prefix_cache.py

Tiny random dense and hybrid pairs in float64 (no two logits tie by accident), blocks of 4
tokens and prefill chunks of 8, so prompts of a few dozen tokens cross many block and chunk
boundaries. A conversation: system prompt and user turn, the answer fed back with a tool result,
another user turn, a turn whose history diverges inside an earlier answer, the same prompt
again, and a turn that extends it.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from engine.cache_pool import CachePool, chunk_bounds
from engine.decode import GenerationConfig, generate
from engine.kv_blocks import KVBlockPool, KVLayout, PagedKVCache
from engine.prefix_cache import PrefixCache
from tests.helpers.oracle_drafter import OracleDrafter
from tests.helpers.tiny_pairs import KINDS, load_tiny_pair

BLOCK, CHUNK, NEW = 4, 8, 9
SYSTEM, USER_1, TOOL, USER_2, USER_3 = (
    [5, 9, 14, 3, 3, 27, 8, 11, 40, 2, 19],
    [31, 7, 22, 60, 13],
    [44, 45, 46, 12, 9, 9, 50, 51, 17],
    [70, 8, 33, 21],
    [61, 62, 5, 5, 18],
)
OTHER = [(7 * i) % 80 + 10 for i in range(90)]  # a prompt longer than the conversation's
CASES = [("ar", 1, 0.0), ("linear", 1, 0.0), ("ddtree", 6, 0.0), ("ddtree", 6, 1.0)]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module", params=KINDS)
def pair(request, tmp_path_factory):
    return load_tiny_pair(
        tmp_path_factory.mktemp(request.param), request.param, dtype=torch.float64
    )


def config(method: str, budget: int, temperature: float, **changes) -> GenerationConfig:
    settings = dict(max_new_tokens=NEW, prefill_chunk=CHUNK, trace=True) | changes
    seed = 7 if temperature else None
    return GenerationConfig(method, budget, temperature=temperature, seed=seed, **settings)


def server_pool(pair, budget_bytes: int = 1 << 30) -> CachePool:
    target, drafter = pair
    pool = CachePool(target, drafter, 256, block_tokens=BLOCK)
    pool.prefix_cache = PrefixCache(
        budget_bytes, recurrent=hasattr(pool.cache, "recurrent"), block_tokens=BLOCK
    )
    return pool


def conversation(run) -> list[tuple[list[int], object]]:
    """(prompt, result) per turn; `run(prompt)` generates one turn."""
    turns = []

    def turn(prompt):
        turns.append((prompt, run(prompt)))
        return turns[-1][1].output_ids

    p1 = SYSTEM + USER_1
    a1 = turn(p1)
    p2 = p1 + a1 + TOOL
    a2 = turn(p2)
    p3 = p2 + a2 + USER_2
    a3 = turn(p3)
    # the history re-rendered with a token of the second answer changed (a template that shows
    # earlier answers differently): it diverges 4 tokens into that answer
    a2_shown = [*a2[:4], (a2[4] + 1) % 90 + 3, *a2[5:]]
    p4 = p2 + a2_shown + USER_2 + a3 + USER_3
    a4 = turn(p4)
    turn(p4)  # the same prompt again
    turn(p4 + a4 + TOOL)
    return turns


def expected_cached(kind: str, turns) -> list[int]:
    """What each turn should find cached: the previous prompt and answer but its last token
    (the generation end's snapshot); at the divergence, on the hybrid the second prompt's end
    (its last snapshot before it), on the dense target the last block boundary before it."""
    (p1, r1), (p2, r2), (p3, r3), (p4, _), (_, r5), _ = turns
    diverged = len(p2) + 4
    return [
        0,
        len(p1) + len(r1.output_ids) - 1,
        len(p2) + len(r2.output_ids) - 1,
        len(p2) if kind == "hybrid" else max(len(p2), diverged // BLOCK * BLOCK),
        len(p4),
        len(p4) + len(r5.output_ids) - 1,
    ]


@pytest.mark.parametrize(("method", "budget", "temperature"), CASES)
def test_a_conversation_decodes_the_same_with_the_cache_on_and_off(
    pair, method, budget, temperature
):
    target, drafter = pair
    cfg = config(method, budget, temperature)
    cold = conversation(lambda prompt: generate(target, drafter, prompt, cfg))
    pool = server_pool(pair)

    def interleaved(prompt):  # another request first: the pool's caches hold its tokens
        generate(target, drafter, OTHER, replace(cfg, cache_prompt=False), pool=pool)
        return generate(target, drafter, prompt, cfg, pool=pool)

    warm = conversation(interleaved)
    for (prompt, off), (same_prompt, on) in zip(cold, warm, strict=True):
        assert same_prompt == prompt
        assert on.output_ids == off.output_ids
        assert on.rounds == off.rounds  # every draft tree too: the drafter's context was reused
        assert off.cached_tokens == 0
    kind = "hybrid" if hasattr(pool.cache, "recurrent") else "dense"
    assert [on.cached_tokens for _, on in warm] == expected_cached(kind, warm)
    assert 0 < pool.prefix_cache.used_bytes <= pool.prefix_cache.budget_bytes


@pytest.mark.parametrize("checkpoint", [True, False])
def test_a_checkpoint_is_where_a_history_without_the_generation_prompt_resumes(pair, checkpoint):
    """The next turn renders the answer without the generation prompt's last tokens (an empty
    think block): it diverges before the first prompt's end; the server's checkpoint where the
    messages end is a snapshot there."""
    target, drafter = pair
    pool = server_pool(pair)
    messages, think = SYSTEM + USER_2, [3, 4, 5]  # 15 tokens: not a chunk or block boundary
    marks = (len(messages),) if checkpoint else ()
    cfg = config("ddtree", 6, 0.0, checkpoints=marks)
    first = generate(target, drafter, messages + think, cfg, pool=pool)
    prompt = messages + first.output_ids + TOOL
    second = generate(target, drafter, prompt, cfg, pool=pool)
    assert second.output_ids == generate(target, drafter, prompt, cfg).output_ids
    hybrid = hasattr(pool.cache, "recurrent")
    fallback = CHUNK if hybrid else len(messages) // BLOCK * BLOCK  # a chunk's or block's end
    assert second.cached_tokens == (len(messages) if checkpoint else fallback)


def test_cache_prompt_false_neither_reuses_nor_stores(pair):
    target, drafter = pair
    pool = server_pool(pair)
    cfg = config("ddtree", 6, 0.0)
    first = generate(target, drafter, SYSTEM + USER_1, cfg, pool=pool)
    history = SYSTEM + USER_1 + first.output_ids
    off = generate(
        target, drafter, history + TOOL, config("ddtree", 6, 0.0, cache_prompt=False), pool=pool
    )
    assert off.cached_tokens == 0
    again = generate(target, drafter, history + TOOL + off.output_ids + USER_2, cfg, pool=pool)
    assert again.cached_tokens == len(history) - 1  # the first turn's, nothing of the second's


def test_an_ar_turn_leaves_no_drafter_state_a_ddtree_turn_can_use(pair):
    target, drafter = pair
    pool = server_pool(pair)
    first = generate(target, drafter, SYSTEM + USER_1, config("ar", 1, 0.0), pool=pool)
    prompt = SYSTEM + USER_1 + first.output_ids + TOOL
    speculative = generate(target, drafter, prompt, config("ddtree", 6, 0.0), pool=pool)
    assert speculative.cached_tokens == 0
    assert (
        speculative.output_ids
        == generate(target, drafter, prompt, config("ddtree", 6, 0.0)).output_ids
    )
    as_ar = generate(target, drafter, prompt, config("ar", 1, 0.0), pool=pool)
    assert as_ar.cached_tokens == len(prompt)  # the ddtree turn's prompt end, logits and all


def test_the_budget_holds_and_the_least_recently_used_goes_first(pair):
    target, drafter = pair
    cfg = config("ddtree", 6, 0.0)
    probe = server_pool(pair)
    generate(target, drafter, SYSTEM + USER_1, cfg, pool=probe)
    one_conversation = probe.prefix_cache.used_bytes
    pool = server_pool(pair, budget_bytes=one_conversation * 3 // 2)
    first, second = SYSTEM + USER_1, USER_3 + TOOL + USER_2
    a = generate(target, drafter, first, cfg, pool=pool)
    b = generate(target, drafter, second, cfg, pool=pool)
    assert pool.prefix_cache.used_bytes <= pool.prefix_cache.budget_bytes
    again_b = generate(target, drafter, second + b.output_ids, cfg, pool=pool)
    assert again_b.cached_tokens == len(second) + len(b.output_ids) - 1
    again_a = generate(target, drafter, first + a.output_ids, cfg, pool=pool)
    assert again_a.cached_tokens < len(first)  # evicted to make room for the second
    assert again_a.output_ids == generate(target, drafter, first + a.output_ids, cfg).output_ids


def test_a_hit_shares_the_cached_blocks_and_copies_only_a_tail_it_writes(pair):
    """The next turn's caches start on the very blocks the cache holds (references, no copy),
    target and drafter alike; the partly filled tail block is copied at the first write into it,
    the cached one left as it was."""
    target, drafter = pair
    cfg = config("ddtree", 6, 0.0)
    pool = server_pool(pair)
    first = generate(target, drafter, SYSTEM + USER_1[:4], cfg, pool=pool)  # 15 + 9 tokens
    prompt = SYSTEM + USER_1[:4] + first.output_ids + TOOL
    caches = pool.open(speculative=True, cache_prompt=True)
    cached = caches.resume(prompt)
    hit = pool.prefix_cache.lookup(prompt, drafted=True)
    assert cached == hit.position and cached % BLOCK  # this turn resumes inside a block
    whole = cached // BLOCK
    kv = getattr(caches.cache, "kv", caches.cache)
    for cache, held, tail in [
        (kv, [b.target for b in hit.path], hit.snapshot.target_tail),
        (caches.draft_cache, [b.draft for b in hit.path], hit.snapshot.draft_tail),
    ]:
        assert cache.blocks == [h.block for h in held] + [tail.block]  # shared, not copied
        assert all(cache.pool.refs[block] >= 2 for block in cache.blocks)  # the cache too
        before, refs = cache.read(whole * BLOCK, cached), cache.pool.refs[tail.block]
        cache.check_room(1)  # a pass is about to write slot `cached`, inside the tail block
        assert cache.blocks[:whole] == [h.block for h in held]
        assert cache.blocks[whole] != tail.block and cache.pool.refs[cache.blocks[whole]] == 1
        assert cache.pool.refs[tail.block] == refs - 1  # the cached tail, no longer ours
        torch.testing.assert_close(cache.read(whole * BLOCK, cached), before)
    caches.abandon()


def test_a_zero_budget_caches_nothing_and_changes_nothing(pair):
    target, drafter = pair
    cfg = config("ddtree", 6, 0.0)
    pool = server_pool(pair, budget_bytes=0)
    turns = conversation(lambda prompt: generate(target, drafter, prompt, cfg, pool=pool))
    assert all(result.cached_tokens == 0 for _, result in turns)
    assert pool.prefix_cache.used_bytes == 0


def test_the_pool_allocates_its_caches_once_and_holds_one_pass_a_kind(pair):
    """The caches are the pool's for every request; on the CPU a static pass is rebuilt for
    each round's exact key window (graph passes are reused: the next test), in its kind's one
    place, so passes never pile up across requests."""
    target, drafter = pair
    pool = server_pool(pair)
    cache, draft_cache = pool.cache, pool.draft_cache
    cfg = config("ddtree", 6, 0.0, max_new_tokens=3)
    for prompt in (SYSTEM, USER_2, USER_2, USER_2[:3]):
        generate(target, drafter, prompt, cfg, pool=pool)
        assert pool.cache is cache and pool.draft_cache is draft_cache
    assert [kind[0] for kind in pool.passes].count("verify") == 1


def test_a_pool_keeps_few_captured_pass_shapes_whatever_the_budgets_asked():
    """Requests of many budgets: the graph passes of the HELD_SHAPES most recently used shapes of
    each name stay."""
    from engine.decode import _Passes

    pool, built = {}, []
    passes = _Passes(pool, graphs=True)
    for width in (16, 5, 8, 16, 33, 16):
        for name in ("verify", "draft"):
            passes.get((name, width), 64, lambda keys: built.append(keys) or object())
    assert list(pool) == [("verify", 8), ("draft", 8), ("verify", 33), ("draft", 33)] + [
        ("verify", 16),
        ("draft", 16),
    ]
    assert len(built) == 8  # 33 dropped 5, not 16 (used since): each shape built once


def test_a_failed_generation_gives_its_captures_back(pair):
    target, drafter = pair
    pool = server_pool(pair)
    cfg = config("ddtree", 6, 0.0)

    def fail(tokens):
        raise RuntimeError("client gone")

    with pytest.raises(RuntimeError):
        generate(target, drafter, SYSTEM + USER_1 + TOOL, cfg, pool=pool, on_tokens=fail)
    assert pool.prefix_cache.used_bytes == 0


def test_out_of_memory_before_the_first_token_retries_with_the_cache_emptied(pair):
    target, drafter = pair
    pool = server_pool(pair)
    cfg = config("ar", 1, 0.0)
    generate(target, drafter, SYSTEM, cfg, pool=pool)
    assert pool.prefix_cache.used_bytes
    calls = []

    def attempt(on_tokens):
        calls.append(pool.prefix_cache.used_bytes)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return generate(target, drafter, SYSTEM + USER_1, cfg, pool=pool, on_tokens=on_tokens)

    result = pool.run(attempt)
    assert calls[0] > 0 and calls[1] == 0 and result.cached_tokens == 0

    def late(on_tokens):
        on_tokens([1])
        raise torch.OutOfMemoryError("CUDA out of memory")

    with pytest.raises(torch.OutOfMemoryError):
        pool.run(late)


def test_chunks_end_where_a_cold_prefill_s_do():
    assert chunk_bounds(0, 20, 8) == [(0, 8), (8, 16), (16, 20)]
    assert chunk_bounds(11, 20, 8) == [(11, 16), (16, 20)]
    assert chunk_bounds(16, 17, 8) == [(16, 17)]
    assert chunk_bounds(5, 5, 8) == []
    assert chunk_bounds(3, 20, 8, checkpoints=(2, 5, 16, 20, 30)) == [
        (3, 5),
        (5, 8),
        (8, 16),
        (16, 20),
    ]


def test_the_cache_keeps_the_output_but_its_last_token_when_a_stop_ends_a_path(pair):
    """A stop token inside an accepted path: what the round accepted after it is not
    committed, so the next turn (which follows the output) can extend the cache."""
    target, _ = pair
    prompt = SYSTEM + USER_1
    expected = generate(target, None, prompt, config("ar", 1, 0.0, max_new_tokens=12)).output_ids
    at = next(i for i in range(3, 12) if expected[i] not in expected[:i])  # its first time
    oracle = OracleDrafter(prompt + expected, target.config.vocab_size, block_size=8)
    pool = CachePool(target, oracle, 256)
    cfg = config("linear", 1, 0.0, max_new_tokens=12, stop_token_ids=(expected[at],))
    result = generate(target, oracle, prompt, cfg, pool=pool)
    assert result.output_ids == expected[: at + 1] and result.acceptance_lengths[0] == at
    assert pool.cache.length == len(prompt) + len(result.output_ids) - 1


def paged_kv(length: int, block_tokens: int) -> PagedKVCache:
    """A cache of `length` committed tokens over its own pool: 8 bytes a slot (K and V of one
    float32)."""
    layout = KVLayout(1, 1, 1, torch.float32, torch.device("cpu"))
    cache = PagedKVCache(KVBlockPool.for_tokens(layout, length, block_tokens), length)
    cache.advance(length)
    return cache


def test_a_drafted_snapshot_replaces_one_evicted_to_make_room_for_it():
    """An ar turn's snapshot (no drafter K/V) is replaced by a ddtree turn's at the same
    position; under a tight budget the replacement's own tail evicts the old one first."""
    cache = PrefixCache(128, recurrent=False, block_tokens=4)
    tokens = [1, 2, 3, 4, 5, 6]
    cache.store(tokens, paged_kv(6, 4), None, [])  # a block (32 bytes), a 2-token tail's (32)
    # + the block's draft (32), the tail's (32), the draft tail's (32): the old tail must go
    cache.store(tokens, paged_kv(6, 4), paged_kv(6, 4), [])
    assert cache.used_bytes == 128
    hit = cache.lookup([*tokens, 7], drafted=False)
    assert hit.position == 6 and hit.snapshot.target_tail is not None


def test_a_path_deeper_than_the_recursion_limit_is_cleared():
    """Qwen3.6's 262144-token context is 1024 blocks deep: clearing drops it without recursion."""
    import sys

    depth = sys.getrecursionlimit() + 100
    kv = paged_kv(depth, 1)
    cache = PrefixCache(1 << 20, recurrent=False, block_tokens=1)
    cache.store(list(range(depth)), kv, None, [])
    assert cache.lookup([*range(depth), 0], drafted=False).position == depth
    cache.clear()
    assert cache.used_bytes == 0 and cache.lookup(list(range(depth)), drafted=False).position == 0


def test_a_long_prefill_s_chunk_snapshots_give_way_to_its_blocks_and_its_end(pair):
    """A budget that holds a turn's blocks and the snapshots at its ends but not one at every
    chunk: the earliest chunk snapshots go, and the next turn resumes where this one ended."""
    target, drafter = pair
    cfg = config("ddtree", 6, 0.0)
    roomy = server_pool(pair)
    if not hasattr(roomy.cache, "recurrent"):
        pytest.skip("a dense target's chunk ends hold no state")
    first = generate(target, drafter, OTHER, cfg, pool=roomy)  # 90 tokens: 11 chunk ends
    states = sum(s.conv.nbytes + s.recurrent.nbytes for s in roomy.cache.recurrent)
    pool = server_pool(pair, budget_bytes=roomy.prefix_cache.used_bytes - 6 * states)
    assert generate(target, drafter, OTHER, cfg, pool=pool).output_ids == first.output_ids
    history = OTHER + first.output_ids
    again = generate(target, drafter, history + USER_3, cfg, pool=pool)
    assert again.cached_tokens == len(history) - 1
    assert pool.prefix_cache.used_bytes <= pool.prefix_cache.budget_bytes
    shorter = generate(target, drafter, OTHER[:20] + USER_3, cfg, pool=pool)
    assert shorter.cached_tokens == 0  # the earliest chunk snapshots (8, 16) were the ones to go


def test_a_chat_s_messages_end_is_found_from_its_generation_prompt_s_ids_alone():
    """The tail (the generation prompt) is encoded, not the whole history again; a tail whose
    ids merge across the seam falls back to the history's own ids."""
    from engine.prefix_cache import messages_end

    encoded = []

    def encode(text):  # one id a character, but "ab" is one token
        encoded.append(text)
        return [0 if text[i : i + 2] == "ab" else ord(c) for i, c in enumerate(text)
                if not (i and text[i - 1 : i + 1] == "ab")]  # fmt: skip

    text, history = "sys user<|im_start|>assistant", "sys user"
    assert messages_end(encode(text), text, history, encode) == len(history)
    assert encoded == [text, "<|im_start|>assistant"]
    seam = "xya"
    assert messages_end(encode(seam + "b!"), seam + "b!", seam, encode) == 2
    assert messages_end(encode(history), history, history, encode) == len(history)
