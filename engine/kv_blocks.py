"""Paged KV: one pool of fixed-size K/V blocks per model, and a sequence's cache as a block table.

`KVBlockPool(layout, capacity)` holds K and V as [L, blocks, block_tokens, Hkv, D] for every
attention layer of one model (the target's attention layers; the drafter's layers), with a
reference count per block. A block is taken by `allocate` (the lowest free one, so a lone
sequence's blocks lie in order and read as one slice), shared by `share` (the prefix cache and
the sequences that resume from it) and given back by `release`; at count 0 it is free again.

`PagedKVCache(pool, max_len)` is one sequence's cache: the interface of
engine/models/common.py's `KVCache` (`length`, `max_len`, `check_room`, `store` / `store_at`,
`attend`, `write`, `advance`, `commit`, `reset`, `read` / `place`) over a block table, so the
models, engine/decode.py and a scheduler use either without changing their calls. Slot s of the
sequence lives at slot s % block_tokens of block table[s // block_tokens].

- `check_room(pending)` allocates the blocks for slots length .. length + pending - 1 (the pending
  tokens of a pass: a prefill chunk, a verify tree, a draft block) before the pass writes them,
  and copies a shared block among them first (copy on write: a prefix-cache hit's partly filled
  tail block is written only in the sequence's own copy). Every writer calls it first, outside
  any captured graph: the device table a graph reads changes only there.
- `blocks` (host) and `table` (device, [ceil(max_len / block_tokens)]) name the blocks; entries
  past the allocated ones point at block 0 (never read: the kernels stop at length + pending).
- `adopt(blocks, length)` starts the sequence from shared blocks (a prefix-cache hit): a
  reference on each, nothing copied.

Storage: on CUDA the whole pool is allocated at once when its first block is taken (the memory
plan sizes it; the pool's capacity is set before: every slot's sequence and the prefix cache's
share; captured graphs then read it in place); elsewhere it grows by doubling up to `capacity`
as blocks are first used (a CPU server's plan may leave the prefix cache most of the RAM, which
it should not take at start).
Unwritten storage is zeros: a masked key must still be finite (0 * NaN is NaN).

When no block is free, `reclaim` (set by the prefix cache) is asked to let go of one; a pool that
still has none raises `PoolExhausted`, an out-of-memory error (engine/memory_plan.py).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from engine.kernels import paged_tree_attention, sequence_slots, tree_attention
from engine.memory_plan import BLOCK_TOKENS
from engine.transfer import on_device, to_device


class PoolExhausted(MemoryError):
    """No free block is left in a KV block pool, even after the prefix cache let go of its own."""


@dataclass(frozen=True)
class KVLayout:
    """The K/V geometry of one model's attention layers."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device

    def block_bytes(self, block_tokens: int = BLOCK_TOKENS) -> int:
        """Bytes of one block: K and V of every layer for `block_tokens` tokens."""
        width = torch.empty(0, dtype=self.dtype).element_size()
        return 2 * self.layers * block_tokens * self.kv_heads * self.head_dim * width


class KVBlockPool:
    """Fixed-size K/V blocks with reference counts (see the module docstring)."""

    def __init__(self, layout: KVLayout, capacity: int, block_tokens: int = BLOCK_TOKENS) -> None:
        if capacity < 1 or block_tokens < 1:
            raise ValueError("a KV block pool needs at least one block of at least one token")
        self.layout, self.capacity, self.block_tokens = layout, capacity, block_tokens
        self.device = torch.device(layout.device)
        allocated = 0 if self.device.type == "cuda" else min(capacity, 4)
        self.k = self._zeros(allocated)
        self.v = self._zeros(allocated)
        self._flat: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # see `flat`
        self.refs = [0] * capacity
        self._free = list(range(allocated))  # a heap: the lowest free block first
        self.reclaim: Callable[[], bool] | None = None
        self.cache_blocks = 0  # of the capacity, the prefix cache's share (hold_for_cache)
        self._padding: int | None = None  # see `padding_block`

    @classmethod
    def for_tokens(
        cls, layout: KVLayout, tokens: int, block_tokens: int = BLOCK_TOKENS, spare: int = 0
    ) -> KVBlockPool:
        """A pool for `tokens` tokens of sequences (whole blocks) plus `spare` blocks."""
        return cls(layout, -(-tokens // block_tokens) + spare, block_tokens)

    def grow_by(self, blocks: int) -> None:
        """`blocks` more blocks of capacity (another sequence's, a prefix cache's share). On
        CUDA only before the first block is taken: the storage, allocated then, never moves
        (captured graphs read it)."""
        if blocks <= 0:
            return
        if self.device.type == "cuda" and self.k.shape[1]:
            raise RuntimeError("a CUDA KV block pool grows only before its first block is used")
        self.refs += [0] * blocks
        self.capacity += blocks

    def limit(self, capacity: int) -> None:
        """`capacity` blocks in all, fewer than the sequences could fill (an oversubscribed
        pool: engine/scheduler.py preempts a sequence when it runs short); before any block
        beyond it is allocated."""
        if capacity < 1 or any(self.refs[capacity:]):
            raise ValueError(f"cannot limit a pool with blocks in use to {capacity} blocks")
        if self.k.shape[1] > capacity:  # storage made ahead on the CPU: the unused goes
            self.k, self.v = self.k[:, :capacity].clone(), self.v[:, :capacity].clone()
            self._flat = None
            self._free = [block for block in self._free if block < capacity]
            heapq.heapify(self._free)
        self.refs = self.refs[:capacity] + [0] * (capacity - len(self.refs))
        self.capacity = capacity

    def hold_for_cache(self, blocks: int) -> None:
        """Capacity for a prefix cache holding up to `blocks` blocks (once per pool)."""
        self.grow_by(blocks - self.cache_blocks)
        self.cache_blocks = max(self.cache_blocks, blocks)

    def padding_block(self) -> int:
        """A block of its own that rows no sequence owns store their K/V in, never read (a
        static step's padding rows: engine/step_passes.py): taken once, the capacity grown by
        it (on CUDA, where the storage is made at the first block, when asked before that)."""
        if self._padding is None:
            if not (self.device.type == "cuda" and self.k.shape[1]):
                self.grow_by(1)
            self._padding = self.allocate()
        return self._padding

    def _zeros(self, blocks: int) -> torch.Tensor:
        L, H, D = self.layout.layers, self.layout.kv_heads, self.layout.head_dim
        shape = (L, blocks, self.block_tokens, H, D)
        return torch.zeros(shape, dtype=self.layout.dtype, device=self.device)

    @property
    def block_bytes(self) -> int:
        return self.layout.block_bytes(self.block_tokens)

    @property
    def free_blocks(self) -> int:
        """Blocks free now or not yet allocated."""
        return len(self._free) + self.capacity - self.k.shape[1]

    def allocate(self) -> int:
        """A free block (its count 1); asks `reclaim` for one, then raises PoolExhausted."""
        while not self._free:
            if self.k.shape[1] < self.capacity:
                self._grow()
            elif self.reclaim is None or not self.reclaim():
                raise PoolExhausted(
                    f"KV block pool exhausted: {self.capacity} blocks of {self.block_tokens} "
                    f"tokens ({self.capacity * self.block_bytes} bytes) all in use"
                )
        block = heapq.heappop(self._free)
        self.refs[block] = 1
        return block

    def _grow(self) -> None:
        """More storage, the blocks kept: on CUDA all `capacity` at once, elsewhere twice as
        much (at most `capacity`)."""
        old = self.k.shape[1]
        new = self.capacity if self.device.type == "cuda" else min(self.capacity, 2 * old)
        for name in ("k", "v"):
            grown = self._zeros(new)
            grown[:, :old] = getattr(self, name)
            setattr(self, name, grown)
        self._flat = None
        for block in range(old, new):
            heapq.heappush(self._free, block)

    def flat(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's K and V as [blocks * block_tokens, Hkv, D] views, made once for the
        storage (each layer's are asked for several times a pass)."""
        if self._flat is None:
            self._flat = [
                (k.flatten(0, 1), v.flatten(0, 1)) for k, v in zip(self.k, self.v, strict=True)
            ]
        return self._flat[layer]

    def store(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [N, Hkv, D] written at pool `slots` [N] of `layer` (any sequences' slots)."""
        keys, values = self.flat(layer)
        keys.index_copy_(0, slots, k)
        values.index_copy_(0, slots, v)

    def move(self, sources: list[int], targets: list[int]) -> None:
        """Every layer's K and V at pool slots `sources` copied to `targets` (any sequences'),
        one gather and one scatter each."""
        index = to_device(np.array([sources, targets], dtype=np.int64), self.device)
        for whole in (self.k.flatten(1, 2), self.v.flatten(1, 2)):
            whole[:, index[1]] = whole[:, index[0]]  # advanced indexing gathers a copy first

    def share(self, block: int) -> int:
        """One more reference to `block` (which must be in use); returns it."""
        if self.refs[block] < 1:
            raise ValueError(f"block {block} is free: nothing to share")
        self.refs[block] += 1
        return block

    def release(self, block: int) -> None:
        """One reference fewer; the block is free at none."""
        if self.refs[block] < 1:
            raise ValueError(f"block {block} released more often than taken")
        self.refs[block] -= 1
        if not self.refs[block]:
            heapq.heappush(self._free, block)

    def copy_of(self, block: int) -> int:
        """A new block holding what `block` holds (copy on write)."""
        copy = self.allocate()
        self.k[:, copy] = self.k[:, block]
        self.v[:, copy] = self.v[:, block]
        return copy


class PagedKVCache:
    """One sequence's K/V as a block table over a pool (see the module docstring)."""

    def __init__(self, pool: KVBlockPool, max_len: int) -> None:
        self.pool, self._max_len = pool, max_len
        self.blocks: list[int] = []
        self._length = 0
        table_len = -(-max_len // pool.block_tokens)
        self.table = torch.zeros(table_len, dtype=torch.long, device=pool.device)
        self._slots: tuple[tuple[int, int], torch.Tensor] | None = None  # the last `physical`
        self._written: list[tuple[torch.Tensor, torch.Tensor]] = []  # recent `store_at`s' slots

    # -- lengths and room ------------------------------------------------------------------

    @property
    def length(self) -> int:
        return self._length

    @length.setter
    def length(self, value: int) -> None:
        if not 0 <= value <= len(self.blocks) * self.pool.block_tokens:
            raise ValueError(f"length {value} beyond the {len(self.blocks)} blocks held")
        self._length = value

    @property
    def max_len(self) -> int:
        return self._max_len

    @property
    def slot_bytes(self) -> int:
        """Bytes of one token's K and V over every layer."""
        return self.pool.block_bytes // self.pool.block_tokens

    def check_room(self, pending: int) -> None:
        """Raise if `pending` more slots do not fit max_len; else hold writable blocks for them."""
        if self._length + pending > self._max_len:
            raise ValueError(
                f"KV cache full: {self._length} committed + {pending} pending > max_len "
                f"{self._max_len}"
            )
        self._hold(self._length, self._length + pending)

    def _hold(self, start: int, end: int) -> None:
        """Blocks for slots start..end-1, each this sequence's own (a shared one is copied)."""
        B, changed = self.pool.block_tokens, False
        while len(self.blocks) * B < end:
            self.blocks.append(self.pool.allocate())
            changed = True
        for index in range(start // B, -(-end // B)):
            block = self.blocks[index]
            if self.pool.refs[block] > 1:
                self.blocks[index] = self.pool.copy_of(block)
                self.pool.release(block)
                changed = True
        if changed:
            self._table_changed()

    def _table_changed(self) -> None:
        self._slots, self._written = None, []
        held = torch.tensor(self.blocks, dtype=torch.long)
        self.table[: len(self.blocks)].copy_(on_device(held, self.table.device))
        self.table[len(self.blocks) :] = 0

    # -- writing and reading ---------------------------------------------------------------

    def physical(self, start: int, end: int) -> torch.Tensor:
        """Pool slots (block * block_tokens + offset) of sequence slots start..end-1 [end-start],
        kept while the table stands (every layer of a pass asks for the same range)."""
        if self._slots is None or self._slots[0] != (start, end):
            slots = torch.arange(start, end, device=self.pool.device)
            physical = sequence_slots(self.table, slots, self.pool.block_tokens)
            self._slots = ((start, end), physical)
        return self._slots[1]

    def _flat(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's K and V as [blocks * block_tokens, Hkv, D] views."""
        return self.pool.flat(layer)

    def _all_layers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of every layer as [L, blocks * block_tokens, Hkv, D] views."""
        return self.pool.k.flatten(1, 2), self.pool.v.flatten(1, 2)

    def store(self, layer: int, offset: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [T, Hkv, D] at slots offset.. (held by check_room)."""
        self.pool.store(layer, self.physical(offset, offset + k.shape[0]), k, v)

    def store_at(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [T, Hkv, D] at device `slots` [T] (a static pass: no host reads)."""
        self.pool.store(layer, self._physical_at(slots), k, v)

    def _physical_at(self, slots: torch.Tensor) -> torch.Tensor:
        """Pool slots of device `slots`, worked out once for the tensor every layer of a pass
        writes (a draft pass writes two: its context's and its block's), while the table
        stands: 5 ops a layer fewer."""
        for written, physical in self._written:
            if written is slots:
                return physical
        physical = sequence_slots(self.table, slots, self.pool.block_tokens)
        self._written = [*self._written[-1:], (slots, physical)]
        return physical

    def keys(self, layer: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's K/V of slots 0..count-1 [count, Hkv, D]: a view of the pool when their
        blocks lie in order, else a gathered copy."""
        B = self.pool.block_tokens
        used = self.blocks[: -(-count // B)]
        first = used[0] if used else 0
        if used == list(range(first, first + len(used))):
            keys, values = self._flat(layer)
            return keys[first * B : first * B + count], values[first * B : first * B + count]
        slots = self.physical(0, count)
        keys, values = self._flat(layer)
        return keys.index_select(0, slots), values.index_select(0, slots)

    def write(
        self, layer: int, offset: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`store`, then the layer's K/V up to the stored slots (see `keys`)."""
        self.store(layer, offset, k, v)
        return self.keys(layer, offset + k.shape[0])

    def attend(
        self,
        layer: int,
        q: torch.Tensor,  # [T, Hq, D] the pending tokens' queries
        prefix_len: int | torch.Tensor,  # committed slots before them
        visible: torch.Tensor | None,  # [T, T] bool among the pending; None = causal
        scale: float,
        keys: int,  # slots that may be read (>= prefix_len + T)
        mask: torch.Tensor | None = None,  # [T, keys] the pass's `kernels.pass_mask`
    ) -> torch.Tensor:  # [T, Hq, D]
        """Tree attention of `q` over the blocks in place: the paged kernel on CUDA; elsewhere
        the contiguous kernel over `keys` (a view when the blocks lie in order)."""
        if reads_blocks_in_place(q):
            k, v = self.pool.k[layer], self.pool.v[layer]
            # Made on the device (no host copy a captured graph would replay from freed memory).
            starts = torch.arange(0, 2 * q.shape[0], max(1, q.shape[0]), device=q.device)
            if isinstance(prefix_len, torch.Tensor):
                prefix = prefix_len.view(1)
            else:
                prefix = torch.full((1,), prefix_len, dtype=torch.long, device=q.device)
            return paged_tree_attention(q, k, v, self.table[None], starts, prefix, visible, scale)
        held = len(self.blocks) * self.pool.block_tokens
        if keys > held:
            keys, mask = held, None if mask is None else mask[:, :held]
        return tree_attention(q, *self.keys(layer, keys), prefix_len, visible, scale, mask)

    # -- committing ------------------------------------------------------------------------

    def advance(self, count: int) -> None:
        """The `count` pending slots after the committed ones are committed (a prefill chunk)."""
        self.check_room(count)
        self._length += count

    def commit(self, accepted: torch.Tensor) -> None:
        """Pending slots length + accepted[i] become committed slot length + i."""
        count = accepted.shape[0]
        self.check_room(count)
        start = self._length
        source = sequence_slots(
            self.table, start + on_device(accepted, self.table.device), self.pool.block_tokens
        )
        target = self.physical(start, start + count)
        for flat in self._all_layers():
            flat[:, target] = flat[:, source]  # advanced indexing gathers a copy first
        self._length = start + count

    def moves(self, path: list[int]) -> tuple[list[int], list[int]]:
        """Commit the pending path `path` (root first) in the table, and return the pool slots
        its K/V must move from and to (`KVBlockPool.move`): pending slot length + path[i]
        becomes committed slot length + i; slots already in place are left out."""
        self.check_room(len(path))
        start, B = self._length, self.pool.block_tokens
        sources, targets = [], []
        for i, node in enumerate(path):
            if node != i:
                for slots, slot in ((sources, start + node), (targets, start + i)):
                    slots.append(self.blocks[slot // B] * B + slot % B)
        self._length = start + len(path)
        return sources, targets

    def reset(self) -> None:
        """Empty: every block given back (those the prefix cache shares stay with it)."""
        for block in self.blocks:
            self.pool.release(block)
        self.blocks = []
        self._length = 0
        self._table_changed()

    def adopt(self, blocks: list[int], length: int) -> None:
        """Start from shared `blocks` (a reference on each) holding `length` tokens."""
        if self.blocks:
            raise ValueError("adopt needs an empty cache")
        self.blocks = [self.pool.share(block) for block in blocks]
        self._table_changed()
        self.length = length

    def read(self, start: int, end: int) -> torch.Tensor:
        """A copy of slots start..end-1 of every layer: [2, L, end - start, Hkv, D] (K, V)."""
        slots = self.physical(start, end)
        return torch.stack([flat[:, slots] for flat in self._all_layers()])

    def place(self, start: int, saved: torch.Tensor) -> None:
        """Write a `read` copy back at slots start..; `length` is the caller's to set."""
        end = start + saved.shape[2]
        self._hold(start, end)
        slots = self.physical(start, end)
        for flat, part in zip(self._all_layers(), saved, strict=True):
            flat[:, slots] = part


def commit_paths(caches: list, paths: list[list[int]]) -> None:
    """Each cache's pending path (host lists, root first) committed after a batched pass: one
    whose path is its first pending slots in order (an ar step) in place, the rest of one block
    pool's caches with one gather and one scatter of its K and V (a contiguous cache alone)."""
    moves: dict[int, tuple[KVBlockPool, list[int], list[int]]] = {}
    for cache, path in zip(caches, paths, strict=True):
        if path == list(range(len(path))):
            cache.advance(len(path))
        elif isinstance(cache, PagedKVCache):
            pool, sources, targets = moves.setdefault(id(cache.pool), (cache.pool, [], []))
            more_sources, more_targets = cache.moves(path)
            sources += more_sources
            targets += more_targets
        else:
            cache.commit(torch.tensor(path))
    for pool, sources, targets in moves.values():
        pool.move(sources, targets)


def reads_blocks_in_place(q: torch.Tensor) -> bool:
    """Whether attention over a block table runs the paged kernel (CUDA), not the contiguous
    one over a view or a gathered copy (the CPU, where a lone sequence's blocks are in order)."""
    return q.is_cuda


def shared_pool(caches: list) -> KVBlockPool | None:
    """The pool every one of `caches` is a block table over, if they share one (None else)."""
    if not caches or not all(isinstance(cache, PagedKVCache) for cache in caches):
        return None
    return caches[0].pool if len({id(cache.pool) for cache in caches}) == 1 else None


@dataclass
class PagedSequences:
    """Sequences of one pool attending together in one `paged_tree_attention` launch (what a
    batched pass runs on CUDA): their block tables, first rows, committed lengths, tree masks
    and the pool slots of their pending K/V, made once a pass (`of`). Each layer then stores
    every sequence's pending K/V in one copy and attends in one launch, with no work a
    sequence (at Qwen3.6-27B's 16 attention layers and 5 drafter layers, ~7 small calls a
    sequence a layer made each time: ~2,350 a step of 16)."""

    pending: torch.Tensor  # [N] the pool slots the pass's rows store their K/V at, in order
    tables: torch.Tensor  # [B, W] each sequence's block table (zero-padded to the widest)
    starts: torch.Tensor  # [B + 1] each sequence's first row of the pass, then N
    prefixes: torch.Tensor  # [B] each sequence's committed length
    mask: torch.Tensor | None  # [N, widest T] each row's visible pending tokens; None: causal

    @classmethod
    def of(
        cls,
        caches: list[PagedKVCache],
        rows: list[slice],  # each sequence's rows of the pass: in order, together all of it
        visible: list[torch.Tensor | None],  # each sequence's [T, T] mask; None = causal
    ) -> PagedSequences:
        pool = caches[0].pool
        if any(cache.pool is not pool for cache in caches):
            raise ValueError("sequences attended together must share one KV block pool")
        if rows[0].start != 0 or any(a.stop != b.start for a, b in itertools.pairwise(rows)):
            raise ValueError("a paged launch's sequences must hold the pass's rows in order")
        device, block = pool.device, pool.block_tokens
        width = max(cache.table.shape[0] for cache in caches)
        tables = torch.stack(
            [F.pad(cache.table, (0, width - cache.table.shape[0])) for cache in caches]
        )
        counts = [r.stop - r.start for r in rows]
        lengths = [cache.length for cache in caches]
        owner = np.repeat(np.arange(len(caches)), counts)
        slot = np.concatenate([np.arange(n, n + T) for n, T in zip(lengths, counts, strict=True)])
        owner, slot = to_device(np.stack([owner, slot]), device)
        pending = tables[owner, slot // block] * block + slot % block
        bounds = to_device(np.array([0, *(r.stop for r in rows)]), device)
        mask = None
        if any(seen is not None for seen in visible):
            mask = torch.zeros(rows[-1].stop, max(counts), dtype=torch.bool, device=device)
            for r, T, seen in zip(rows, counts, visible, strict=True):
                causal = seen is None
                mask[r, :T] = torch.ones(T, T, device=device).tril() if causal else seen
        return cls(pending, tables, bounds, to_device(np.array(lengths), device), mask)

    def attend(
        self,
        pool: KVBlockPool,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:  # [N, Hq, D]
        """Store the pass's pending k, v [N, Hkv, D] in the sequences' blocks, then attend every
        query q [N, Hq, D] over its own sequence's keys."""
        pool.store(layer, self.pending, k, v)
        args = (self.tables, self.starts, self.prefixes, self.mask, scale)
        return paged_tree_attention(q, pool.k[layer], pool.v[layer], *args)


@dataclass
class PaddedSequences:
    """Sequences of one pool with the same number of pending tokens T, attending together on
    the CPU: their keys gathered from their blocks into one padded batch [B, S] (S: the
    longest one's committed + T), one attention call a layer instead of one per sequence.
    Made once a pass (`of`); every layer of the pass reuses its slots and mask."""

    rows: torch.Tensor | slice  # [B * T] the sequences' rows of the pass, in order (a slice
    # when they follow one another: read as views, not gathered)
    pending: torch.Tensor  # [B * T] the pool slots their pending K/V are stored at
    keys: torch.Tensor  # [B * S] the pool slots each reads (past its own end: masked)
    mask: torch.Tensor  # [B, 1, T, S] added to the scores: 0 where a key is seen, -inf not
    shape: tuple[int, int, int]  # B, T, S

    @classmethod
    def of(
        cls,
        caches: list[PagedKVCache],
        rows: list[slice],  # each sequence's rows of the pass
        visible: list[torch.Tensor | None],  # each sequence's [T, T] mask; None = causal
        dtype: torch.dtype,
    ) -> PaddedSequences:
        pool = caches[0].pool
        B, T = len(caches), rows[0].stop - rows[0].start
        lengths = [cache.length for cache in caches]
        S = max(lengths) + T
        tables = torch.stack([cache.table for cache in caches])  # [B, W]
        slots = torch.arange(S, device=pool.device)
        block = (slots // pool.block_tokens).clamp(max=tables.shape[1] - 1)
        keys = tables[:, block] * pool.block_tokens + slots % pool.block_tokens  # [B, S]
        committed = to_device(np.array(lengths), pool.device)[:, None]  # [B, 1]
        ahead = committed + torch.arange(T, device=pool.device)  # [B, T] their pending slots
        seen = _keys_seen(slots - committed, visible, T)
        mask = torch.zeros(B, 1, T, S, dtype=dtype, device=pool.device)
        return cls(
            _rows_of(rows, pool.device),
            keys.gather(1, ahead).flatten(),
            keys.flatten(),
            mask.masked_fill_(~seen[:, None], float("-inf")),
            (B, T, S),
        )

    def covers(self, rows: int) -> bool:
        """Whether these are all `rows` rows of the pass, in order."""
        return isinstance(self.rows, slice) and self.rows == slice(0, rows)

    def attend(
        self,
        pool: KVBlockPool,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:  # [B * T, Hq, D]
        """Store the sequences' pending k, v (rows of the pass's [N, Hkv, D]) in their blocks,
        then attend their queries (rows of q [N, Hq, D]) over their keys."""
        B, T, S = self.shape
        pool.store(layer, self.pending, k[self.rows], v[self.rows])
        K, V = (
            storage.index_select(0, self.keys).view(B, S, *storage.shape[1:]).transpose(1, 2)
            for storage in pool.flat(layer)
        )  # [B, Hkv, S, D]
        Q = q[self.rows].view(B, T, *q.shape[1:]).transpose(1, 2)  # [B, Hq, T, D]
        out = F.scaled_dot_product_attention(Q, K, V, self.mask, scale=scale, enable_gqa=True)
        return out.transpose(1, 2).reshape(B * T, *q.shape[1:])


def _rows_of(rows: list[slice], device: torch.device) -> torch.Tensor | slice:
    """The rows of the pass `rows` name, in order: one slice when they follow one another."""
    if all(a.stop == b.start for a, b in itertools.pairwise(rows)):
        return slice(rows[0].start, rows[-1].stop)
    return to_device(np.concatenate([np.arange(r.start, r.stop) for r in rows]), device)


def _keys_seen(
    column: torch.Tensor,  # [B, S] each key's slot less its sequence's committed length
    visible: list[torch.Tensor | None],  # each sequence's [T, T] mask; None = causal
    T: int,
) -> torch.Tensor:  # [B, T, S] bool
    """`reference.key_visibility` of B sequences at once: every committed key (column < 0),
    the pending ones each one's mask allows, none past its pending tokens."""
    causal = torch.ones(T, T, dtype=torch.bool, device=column.device).tril()
    trees = torch.stack([causal if tree is None else tree.to(column.device) for tree in visible])
    B, S = column.shape
    sees = trees.gather(2, column.clamp(0, T - 1)[:, None, :].expand(B, T, S))
    pending = ((column >= 0) & (column < T))[:, None, :]
    return (column < 0)[:, None, :] | (pending & sees)
