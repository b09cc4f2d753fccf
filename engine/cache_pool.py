"""The caches a server's sequences decode in, allocated once per server, and its prefix cache.

`CachePool(target, drafter, max_len, prefix_cache)` holds the target's cache and the drafter's
for `max_len` tokens and the static passes over them (engine/decode.py): made once, so on CUDA a
pass's graph is captured once for the server (again only when its key window changes), not once
per request. A request takes the caches as a `SequenceCaches` (`pool.open(...)`): emptied, or
resumed from the longest cached prefix of its prompt (`resume`); its prefill snapshots at
every chunk's end (`after_chunk`: chunk boundaries, the request's checkpoints, such as where
a chat's messages end before the generation prompt, and the prompt's end); at the end it gives
the drafter the last features and stores what it committed for the next request (`finish`).

The caches are block tables (engine/kv_blocks.py) over one KV block pool per model, sized for
the sequence and grown by the prefix cache's budget in blocks: a hit hands the sequence the
cached blocks by reference (engine/prefix_cache.py), a store keeps the sequence's own. One
sequence decodes in the pool at a time (batch 1); a scheduler opens a view per running sequence
over the same pools. `paged=False` (and a tensor-parallel target) keeps contiguous caches.

`generate` without a pool makes a throwaway one sized for the request, without a prefix cache.
`pool.run` retries a request that ran out of memory before its first token once with the prefix
cache emptied: a request that fits with the cache off never fails because of the cache.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable, Iterable
from contextlib import suppress
from typing import Any

import torch

from engine.kv_blocks import KVBlockPool, PoolExhausted
from engine.memory_plan import BLOCK_TOKENS, is_out_of_memory
from engine.prefix_cache import Capture, PrefixCache, has_states

log = logging.getLogger(__name__)


def chunk_bounds(
    start: int, end: int, size: int, checkpoints: Iterable[int] = ()
) -> list[tuple[int, int]]:
    """Prefill chunks over tokens start..end-1 that end at multiples of `size`, at each of
    `checkpoints` and at `end`: a prefill resumed mid-prompt runs the chunks a cold one would
    from there on, and one ends wherever a snapshot is wanted."""
    cuts = {*range((start // size + 1) * size, end, size), end}
    cuts.update(c for c in checkpoints if start < c < end)
    ends = sorted(cuts)
    return list(zip([start, *ends[:-1]], ends, strict=True)) if start < end else []


class CachePool:
    """A server's sequence caches and static passes, and its prefix cache (or None)."""

    def __init__(
        self,
        target,
        drafter,
        max_len: int,
        prefix_cache: PrefixCache | None = None,
        block_tokens: int = BLOCK_TOKENS,
        paged: bool = True,
        spare_blocks: int = 0,
        pools: tuple[KVBlockPool | None, KVBlockPool | None] | None = None,
    ):
        """`pools`: the KV block pools (target's, drafter's) of another slot, which grow by this
        one's sequence; else this pool makes its own, with `spare_blocks` more."""
        self.target, self.drafter, self.max_len = target, drafter, max_len
        self.block_tokens, self.spare_blocks, self.paged = block_tokens, spare_blocks, paged
        shared = pools or (None, None)
        self.target_blocks, self.cache = self._caches(target, max_len, max_len, shared[0])
        self.draft_blocks, self.draft_cache = None, None
        if drafter is not None:
            tokens = max_len + drafter.block_size  # its cache holds a block beyond the context
            self.draft_blocks, self.draft_cache = self._caches(drafter, max_len, tokens, shared[1])
        self.passes: dict[Any, Any] = {}  # engine/decode.py's static passes, by kind
        self._prefix_cache: PrefixCache | None = None
        self.prefix_cache = prefix_cache

    @property
    def prefix_cache(self) -> PrefixCache | None:
        return self._prefix_cache

    @prefix_cache.setter
    def prefix_cache(self, cache: PrefixCache | None) -> None:
        """The prefix cache holds blocks of the pools: each grows by the blocks its budget
        holds (a cached token has a target block's and a drafter block's share), and asks it
        for blocks back when it has none free."""
        if cache is not None and self.target_blocks is None:
            raise ValueError("the prefix cache shares KV blocks: it needs paged caches")
        self._prefix_cache = cache
        pools = [p for p in (self.target_blocks, self.draft_blocks) if p is not None]
        per_block = sum(blocks.block_bytes for blocks in pools)
        for blocks in pools:
            blocks.reclaim = cache.reclaim if cache is not None else None
            if cache is not None:  # and a block for a copy on write
                blocks.hold_for_cache(cache.budget_bytes // per_block + 1)

    def _caches(
        self, model, max_len: int, tokens: int, shared: KVBlockPool | None
    ) -> tuple[KVBlockPool | None, Any]:
        """`model`'s KV block pool (`shared`, grown by a sequence of `tokens`, or a new one for
        it and `spare_blocks` more: engine/kv_blocks.py) and the sequence's cache over it; a
        model without a block layout (tensor parallel, a test's drafter) or a pool made unpaged
        has no pool and a contiguous cache."""
        if not self.paged or not hasattr(model, "kv_layout"):
            return None, model.new_cache(max_len)
        if shared is not None:
            shared.grow_by(-(-tokens // self.block_tokens))
            return shared, model.new_cache(max_len, shared)
        layout = model.kv_layout()
        blocks = KVBlockPool.for_tokens(layout, tokens, self.block_tokens, self.spare_blocks)
        return blocks, model.new_cache(max_len, blocks)

    @classmethod
    def for_server(
        cls, target, drafter, max_len: int, cache_bytes: int, block_tokens: int = BLOCK_TOKENS
    ) -> CachePool:
        """The pool of a server: caches for `max_len` tokens plus a draft block, and a prefix
        cache of `cache_bytes` (none when 0)."""
        pool = cls(
            target,
            drafter,
            max_len + (drafter.block_size if drafter is not None else 1),
            block_tokens=block_tokens,
        )
        if cache_bytes:
            pool.prefix_cache = PrefixCache(
                cache_bytes, recurrent=has_states(pool.cache), block_tokens=block_tokens
            )
        return pool

    def slots(self, count: int, kv_tokens: int | None = None) -> list[CachePool]:
        """This pool and `count` - 1 more of its size sharing its prefix cache and its KV block
        pools (each grown by a sequence): the slots of a scheduler's running sequences
        (engine/scheduler.py), each its own block tables and passes. `kv_tokens`: the
        sequences' share of each pool holds that many tokens (whole blocks) instead of
        `count` full sequences; the scheduler preempts a sequence when it runs short."""
        pools = (self.target_blocks, self.draft_blocks)
        more = [
            CachePool(
                self.target,
                self.drafter,
                self.max_len,
                self.prefix_cache,
                self.block_tokens,
                self.paged,
                pools=pools,
            )
            for _ in range(count - 1)
        ]
        if kv_tokens is not None:
            for blocks in (self.target_blocks, self.draft_blocks):
                if blocks is not None:
                    blocks.limit(-(-kv_tokens // self.block_tokens) + blocks.cache_blocks)
        if more and hasattr(self.target, "share_states"):  # a hybrid target's GDN states
            self.target.share_states([pool.cache for pool in (self, *more)])
            self.passes.clear()  # (captured over this slot's states before they moved)
        return [self, *more]

    @property
    def kv_bytes(self) -> int:
        """The KV block pools' bytes (every slot's blocks and the prefix cache's share; 0 for
        contiguous caches): what the memory plan counts as the sequences' caches."""
        pools = [p for p in (self.target_blocks, self.draft_blocks) if p is not None]
        return sum(blocks.capacity * blocks.block_bytes for blocks in pools)

    def open(self, speculative: bool, cache_prompt: bool) -> SequenceCaches:
        """The caches for the next sequence: the drafter's only when `speculative`, the prefix
        cache only when `cache_prompt`."""
        prefix = self.prefix_cache if cache_prompt else None
        return SequenceCaches(self, speculative, prefix)

    def run(self, attempt: Callable[[Callable[[list[int]], None] | None], Any], on_tokens=None):
        """`attempt(on_tokens)` (a generation in this pool); one that runs out of memory before
        any token came out is run again once with the prefix cache emptied."""
        emitted = []

        def counting(tokens: list[int]) -> None:
            emitted.append(len(tokens))
            if on_tokens is not None:
                on_tokens(tokens)

        try:
            return attempt(counting)
        except Exception as error:
            cache = self.prefix_cache
            if emitted or cache is None or not cache.used_bytes or not is_out_of_memory(error):
                raise
        log.warning(
            "out of memory with %d bytes in the prefix cache: emptied, retrying", cache.used_bytes
        )
        cache.clear()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return attempt(on_tokens)


class SequenceCaches:
    """One sequence's use of the pool (see the module docstring)."""

    def __init__(self, pool: CachePool, speculative: bool, prefix: PrefixCache | None) -> None:
        self.pool, self.prefix = pool, prefix
        self.cache = pool.cache
        self.draft_cache = pool.draft_cache if speculative else None
        self.cache.reset()
        if self.draft_cache is not None:
            self.draft_cache.reset()
        self.captures: list[Capture] = []
        self.cached_tokens = 0
        self.logits: torch.Tensor | None = None  # the last prompt token's, when all was cached

    def resume(self, prompt_ids: list[int], whole: bool = False) -> int:
        """Restore the longest cached prefix of the prompt (`whole`: all of it may be, without
        its last logits: PrefixCache.lookup); returns its length (0: none)."""
        if self.prefix is None:
            return 0
        hit = self.prefix.lookup(prompt_ids, drafted=self.draft_cache is not None, whole=whole)
        if hit.position:
            self.prefix.restore(hit, self.cache, self.draft_cache)
        if hit.position == len(prompt_ids):
            self.logits = hit.logits
        self.cached_tokens = hit.position
        return hit.position

    def after_chunk(self, end: int, prompt_len: int, logits: torch.Tensor) -> None:
        """A prefill chunk ended at `end`: snapshot there (the recurrent state's only resume
        points; a dense target's, its tail), with the logits at the prompt's end."""
        if self.prefix is None:
            return
        capture = self.prefix.capture(self.cache, end, logits if end == prompt_len else None)
        if capture is not None:
            self.captures.append(capture)

    def finish(self, committed: list[int], context: torch.Tensor | None) -> None:
        """The sequence ended having committed `committed` (its cache's tokens) and holding the
        drafter's features `context` of the last ones: store it all for the next request."""
        if self.prefix is None:
            return
        if self.draft_cache is not None and context is not None and context.shape[0]:
            with suppress(PoolExhausted):  # a short pool: stored without the drafter's last K/V
                self.pool.drafter.append_context(self.draft_cache, context)
        self.prefix.store(committed, self.cache, self.draft_cache, self.captures)
        self.captures = []

    def abandon(self) -> None:
        """The sequence failed: its captures are not stored."""
        if self.prefix is not None:
            self.prefix.release(self.captures)
        self.captures = []
