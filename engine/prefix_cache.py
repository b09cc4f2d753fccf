"""The server's prefix cache: what a token sequence left in the engine, keyed by its token ids, so a
request whose prompt starts with a cached sequence prefills only the rest.

What is kept:
- **KV blocks** of `block_tokens` tokens: the target's attention K/V and, when a speculative run
  made them, the DFlash drafter's context K/V. They are the sequences' own blocks of the KV block
  pools (engine/kv_blocks.py), held by reference: storing takes a reference on the blocks a
  sequence wrote, a hit gives the next sequence references to them (`PagedKVCache.adopt`), and
  nothing is copied either way. The blocks form a trie keyed by their token ids, so a cached
  sequence is the list of blocks on its path and sequences with a common prefix share them.
- **Snapshots** at exact positions: the Gated DeltaNet layers' conv windows and recurrent states
  (valid at that position only; copies, since a sequence's state is overwritten in place every
  token, so the copy restored into its slot is its copy on write), the block holding the tokens
  after the last whole block (the tail: shared too, and copied by the sequence that resumes from
  it before its first write into it), and at a prompt's end its last token's logits. Taken at prefill chunk boundaries, at the
  prompt's end and at the generation's end (the next turn usually extends prompt + answer), so a
  history that diverges inside an earlier answer resumes from the last snapshot before it.

A prompt resumes at its longest resume point: a snapshot whose path and tail it starts with, or
(dense targets, no recurrent state) any whole-block boundary; never its whole length unless the
snapshot there kept logits (a token is left to prefill, whose logits choose the first output). A
speculative request also needs the drafter's K/V of every reused token.

Memory: a byte budget (the memory plan's, engine/memory_plan.py) over the blocks it holds (a
whole block each, a tail's too) and the snapshots' states; the least recently used go first, and
a pool out of free blocks asks for the same (`reclaim`): a request that would fit without the
cache always gets its blocks. A hit touches its snapshot and
its path; a store touches what it stored, its chunk-boundary snapshots oldest, so under pressure
those go before the snapshots a next turn resumes from, and a block goes before its ancestors
(evicting a block evicts what hangs below it). On a hybrid target a block that no snapshot needs
any more is dropped with the last one. Captures not stored yet (a running prefill's) go only
when nothing stored is left to evict, the earliest first: a long prefill's chunk snapshots never
crowd out its own blocks or the snapshot at its end. `clear()` frees everything (a request that
runs out of memory gets it back, engine/cache_pool.py).

    cache = PrefixCache(budget_bytes=8 << 30, recurrent=True)  # a hybrid target
    hit = cache.lookup(prompt_ids, drafted=True)
    cache.restore(hit, target_cache, draft_cache)  # target_cache.length == hit.position, shared
    ...prefill from hit.position, capture() at chunk boundaries and the prompt's end...
    cache.store(committed_ids, target_cache, draft_cache, captures)
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from engine.kv_blocks import KVBlockPool
from engine.memory_plan import BLOCK_TOKENS


def common_prefix(ids: Sequence[int], others: Sequence[int]) -> int:
    """How many leading tokens two id lists share."""
    for index, (one, other) in enumerate(zip(ids, others, strict=False)):
        if one != other:
            return index
    return min(len(ids), len(others))


def messages_end(
    prompt_ids: Sequence[int], text: str, history: str, encode: Callable[[str], list[int]]
) -> int:
    """Where a chat prompt's messages end among its ids (`text` rendered with the generation
    prompt, `history` without): the prompt less the generation prompt's own ids when they end
    it (a special token starts it, so tokens do not cross the seam), else the common prefix of
    the prompt and the history's ids. Encoding only the tail saves a second encoding of the
    whole conversation on every request (~190 ms at 100k tokens)."""
    if text.startswith(history):
        tail = encode(text[len(history) :])
        if list(prompt_ids[len(prompt_ids) - len(tail) :]) == tail:
            return len(prompt_ids) - len(tail)
    return common_prefix(prompt_ids, encode(history))


def _nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@dataclass(eq=False)
class _Held:
    """A reference the cache holds on one block of a KV block pool."""

    pool: KVBlockPool
    block: int

    @property
    def nbytes(self) -> int:
        return self.pool.block_bytes


def _held_bytes(*held: _Held | None) -> int:
    return sum(h.nbytes for h in held if h is not None)


def _adopt(kv, held: list[_Held | None], hit) -> None:
    """`kv` (an empty paged cache) starts from the held blocks, hit.position tokens."""
    held = [h for h in held if h is not None]
    if any(h.pool is not kv.pool for h in held):
        raise ValueError("a prefix-cache hit's blocks are in another KV block pool")
    kv.adopt([h.block for h in held], hit.position)


def _release(*held: _Held | None) -> None:
    for h in held:
        if h is not None:
            h.pool.release(h.block)


def _attention(cache):
    """The KVCache of a target's cache (a dense target's cache is one)."""
    return getattr(cache, "kv", cache)


def has_states(cache) -> bool:
    """Whether a target's cache holds recurrent (GDN) state, valid at exact positions only."""
    return bool(getattr(cache, "recurrent", None))


@dataclass(eq=False)
class _Block:
    """A trie node: the pool blocks of tokens start .. start + len(tokens) - 1 (the root: none)."""

    tokens: tuple[int, ...]
    parent: _Block | None
    start: int
    target: _Held | None = None
    draft: _Held | None = None  # the drafter's
    children: dict[tuple[int, ...], _Block] = field(default_factory=dict)
    snapshots: dict[tuple[int, ...], _Snapshot] = field(default_factory=dict)

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    @property
    def nbytes(self) -> int:
        return _held_bytes(self.target, self.draft)


@dataclass(eq=False)
class Capture:
    """The state at `position` taken during a sequence's prefill (or at its end), not yet stored."""

    position: int
    states: tuple[torch.Tensor, torch.Tensor] | None  # conv [G, C, K-1], recurrent [G, Hv, Dk, Dv]
    logits: torch.Tensor | None = None  # [1, V] of the token before `position` (a prompt's end)

    @property
    def nbytes(self) -> int:
        return _nbytes(self.logits, *(self.states or ()))


@dataclass(eq=False)
class _Snapshot:
    """A resume point at node.end + len(tail): the block holding the tail's K/V, the recurrent
    states there."""

    node: _Block
    tail: tuple[int, ...]
    capture: Capture
    target_tail: _Held | None = None
    draft_tail: _Held | None = None

    @property
    def position(self) -> int:
        return self.node.end + len(self.tail)

    @property
    def drafted(self) -> bool:
        """The drafter's K/V of the tail are here (the blocks say for themselves)."""
        return not self.tail or self.draft_tail is not None

    @property
    def nbytes(self) -> int:
        return self.capture.nbytes + _held_bytes(self.target_tail, self.draft_tail)


@dataclass
class Hit:
    """Where a prompt resumes: `position` tokens restored from `path` (whole blocks) and
    `snapshot` (its tail, recurrent states and maybe logits)."""

    position: int = 0
    path: list[_Block] = field(default_factory=list)
    snapshot: _Snapshot | None = None

    @property
    def logits(self) -> torch.Tensor | None:
        """The last prompt token's logits when the whole prompt is cached."""
        return self.snapshot.capture.logits if self.snapshot is not None else None


class PrefixCache:
    """The trie of KV blocks and snapshots within `budget_bytes` (see the module docstring);
    `recurrent`: the target has recurrent (GDN) state, so only snapshots are resume points."""

    def __init__(
        self, budget_bytes: int, recurrent: bool, block_tokens: int = BLOCK_TOKENS
    ) -> None:
        if budget_bytes < 0 or block_tokens < 1:
            raise ValueError("the prefix cache needs a budget >= 0 and blocks of >= 1 token")
        self.budget_bytes = budget_bytes
        self.recurrent = recurrent
        self.block_tokens = block_tokens
        self.used_bytes = 0
        self._root = _Block((), None, 0)
        self._lru: OrderedDict[int, _Block | _Snapshot] = OrderedDict()  # oldest first
        self._pending: OrderedDict[int, Capture] = OrderedDict()  # counted, not stored yet

    # -- reuse ---------------------------------------------------------------------------

    def lookup(self, prompt: Sequence[int], drafted: bool, whole: bool = False) -> Hit:
        """The longest resume point of `prompt` (`drafted`: with the drafter's K/V too). Its
        `logits` stand for a prefill only when it covers the whole prompt; `whole`: it may
        cover the whole prompt without them (a preempted sequence's tokens, whose next token
        was chosen before)."""
        best, node, path = Hit(), self._root, []
        B, N = self.block_tokens, len(prompt)
        while True:
            start = node.end
            for tail, snapshot in node.snapshots.items():
                position = start + len(tail)
                usable = position < N or (
                    position == N and (whole or snapshot.capture.logits is not None)
                )
                if (
                    position > best.position
                    and usable
                    and (snapshot.drafted or not drafted)
                    and tuple(prompt[start:position]) == tail
                ):
                    best = Hit(position, list(path), snapshot)
            if not self.recurrent and best.position < start and (start < N or whole):
                best = Hit(start, list(path))
            child = node.children.get(tuple(prompt[start : start + B]))
            if child is None or (drafted and child.draft is None):
                return best
            node = child
            path.append(node)

    def restore(self, hit: Hit, cache, draft_cache=None) -> None:
        """Give a sequence's empty caches the hit's blocks (and the drafter's, to `draft_cache`
        if given) by reference, and copy its recurrent states in; their lengths become
        hit.position."""
        snapshot = hit.snapshot
        tails = (snapshot.target_tail, snapshot.draft_tail) if snapshot else (None, None)
        _adopt(_attention(cache), [block.target for block in hit.path] + [tails[0]], hit)
        if draft_cache is not None:
            _adopt(draft_cache, [block.draft for block in hit.path] + [tails[1]], hit)
        if snapshot is not None and snapshot.capture.states is not None:
            cache.place_states(snapshot.capture.states)
        self._touch([hit.snapshot] if hit.snapshot else [], hit.path[-1] if hit.path else None)

    # -- storing -------------------------------------------------------------------------

    def capture(self, cache, position: int, logits: torch.Tensor | None = None) -> Capture | None:
        """The recurrent states of `cache` now (at `position` committed tokens) and `logits`,
        copied within the budget (older entries evicted); None when they cannot fit."""
        sizes = _nbytes(logits)
        if self.recurrent:
            sizes += sum(_nbytes(s.conv, s.recurrent) for s in cache.recurrent)
        if not self._make_room(sizes):
            return None
        states = cache.read_states() if self.recurrent else None
        capture = Capture(position, states, None if logits is None else logits.clone())
        self.used_bytes += capture.nbytes
        self._pending[id(capture)] = capture
        return capture

    def release(self, captures: Iterable[Capture | None]) -> None:
        """Give back captures that will not be stored (a failed generation's)."""
        for capture in captures:
            if capture is not None and self._pending.pop(id(capture), None) is not None:
                self.used_bytes -= capture.nbytes

    def store(self, tokens: Sequence[int], cache, draft_cache, captures: list[Capture]) -> None:
        """Keep the blocks of `tokens` (the sequence's committed ids: cache.length of them), the
        drafter's K/V where `draft_cache` holds them, and a snapshot per capture plus one at the
        end; what does not fit even after evicting everything older is left out."""
        if len(tokens) != _attention(cache).length:
            raise ValueError(f"{len(tokens)} tokens but {_attention(cache).length} in the cache")
        end = self.capture(cache, len(tokens))  # before the blocks: they may evict nothing new
        ordered = sorted(captures, key=lambda c: c.position) + ([end] if end else [])
        path = self._store_blocks(tokens, cache, draft_cache)
        protect = {id(block) for block in path}
        stored = []
        for capture in reversed(ordered):  # the most useful first: the end, the prompt's end..
            if id(capture) not in self._pending:  # dropped to make room
                continue
            snapshot = self._store_snapshot(capture, tokens, path, cache, draft_cache, protect)
            if snapshot is not None:
                stored.append(snapshot)
                protect.add(id(snapshot))
        self._touch(stored[::-1], path[-1] if path else None)
        if self.recurrent and path:
            self._prune(path[-1], protect=set())

    def _store_blocks(self, tokens: Sequence[int], cache, draft_cache) -> list[_Block]:
        """The path of whole blocks of `tokens`, new ones the caches' own blocks, shared."""
        B = self.block_tokens
        drafted = draft_cache.length if draft_cache is not None else 0
        node, path, protect = self._root, [], set()
        for start in range(0, len(tokens) - B + 1, B):
            key = tuple(tokens[start : start + B])
            child = node.children.get(key)
            if child is None:
                held = self._share(cache, start, protect)
                if held is None:
                    break
                child = _Block(key, node, start, target=held)
                node.children[key] = child
                self._lru[id(child)] = child
            if child.draft is None and drafted >= start + B:
                child.draft = self._share(draft_cache, start, protect | {id(child)})
            node = child
            path.append(node)
            protect.add(id(node))
        return path

    def _store_snapshot(
        self,
        capture: Capture,
        tokens: Sequence[int],
        path: list[_Block],
        cache,
        draft_cache,
        protect: set[int],
    ) -> _Snapshot | None:
        """Link `capture` below its block with its tail's K/V; None when it cannot be kept."""
        protect = protect | {id(capture)}
        depth = capture.position // self.block_tokens
        if depth > len(path):  # its blocks did not fit
            self.release([capture])
            return None
        node = path[depth - 1] if depth else self._root
        tail = tuple(tokens[node.end : capture.position])
        drafted = draft_cache is not None and draft_cache.length >= capture.position
        existing = node.snapshots.get(tail)
        if existing is not None and (existing.drafted or not drafted):
            if existing.capture.logits is None and capture.logits is not None:
                existing.capture.logits = capture.logits  # the bytes move with it
                capture.logits = None
            self.release([capture])
            return existing
        if capture.states is None and not tail and capture.logits is None:
            self.release([capture])
            return None  # a dense target resumes at a block boundary without one
        snapshot = _Snapshot(node, tail, capture)
        if tail:
            snapshot.target_tail = self._share(cache, node.end, protect)
            if snapshot.target_tail is None:
                self.release([capture])
                return None
            if drafted:
                snapshot.draft_tail = self._share(draft_cache, node.end, protect)
        if existing is not None and node.snapshots.get(tail) is existing:  # still there
            self._evict(existing, protect)
        del self._pending[id(capture)]  # its bytes are the snapshot's from here
        node.snapshots[tail] = snapshot
        self._lru[id(snapshot)] = snapshot
        return snapshot

    def _share(self, cache, start: int, protect: set[int]) -> _Held | None:
        """A reference on the block of `cache` (a target's or a drafter's paged cache) that
        holds slot `start` (a block's first), within the budget; None when it cannot fit."""
        kv = _attention(cache)
        if kv.pool.block_tokens != self.block_tokens:
            raise ValueError(
                f"prefix-cache blocks of {self.block_tokens} tokens over a KV pool's of "
                f"{kv.pool.block_tokens}"
            )
        if not self._make_room(kv.pool.block_bytes, protect):
            return None
        held = _Held(kv.pool, kv.pool.share(kv.blocks[start // self.block_tokens]))
        self.used_bytes += held.nbytes
        return held

    # -- eviction ------------------------------------------------------------------------

    def reclaim(self) -> bool:
        """Let go of the least recently used entry (a KV pool out of free blocks asks);
        False when nothing is stored."""
        if not self._lru:
            return False
        self._evict(next(iter(self._lru.values())), set())
        return True

    def clear(self) -> None:
        """Evict everything stored (captures in flight keep their bytes until stored)."""
        for child in list(self._root.children.values()):
            self._evict(child, set())
        for snapshot in list(self._root.snapshots.values()):
            self._evict(snapshot, set())

    def _touch(self, snapshots: list[_Snapshot], leaf: _Block | None) -> None:
        """Mark used now: `snapshots` in order, then the path to `leaf` from the leaf up, so a
        block is always more recent than what hangs below it."""
        for snapshot in snapshots:
            self._lru.move_to_end(id(snapshot))
        node = leaf
        while node is not None and node is not self._root:
            self._lru.move_to_end(id(node))
            node = node.parent

    def _make_room(self, nbytes: int, protect: set[int] = frozenset()) -> bool:
        """Evict least recently used entries (never those in `protect`) until `nbytes` more
        fit the budget; False when they cannot."""
        if nbytes > self.budget_bytes:
            return False
        while self.used_bytes + nbytes > self.budget_bytes:
            victim = next((u for key, u in self._lru.items() if key not in protect), None)
            if victim is not None:
                self._evict(victim, protect)
            elif not self._drop_pending(protect):
                return False
        return True

    def _drop_pending(self, protect: set[int]) -> bool:
        """Give up the earliest capture not stored yet (and not in `protect`) that holds bytes;
        False when there is none. Its sequence's store() then skips it."""
        for key, capture in self._pending.items():
            if key not in protect and capture.nbytes:
                self.release([capture])
                capture.states = capture.logits = None  # its memory goes now, not at the store
                return True
        return False

    def _evict(self, unit: _Block | _Snapshot, protect: set[int]) -> None:
        """Drop `unit` (a block: with everything below it); on a hybrid target also the blocks
        above it that no snapshot needs any more."""
        above = unit.node if isinstance(unit, _Snapshot) else unit.parent
        self._drop(unit)
        if self.recurrent:
            self._prune(above, protect)

    def _drop(self, unit: _Block | _Snapshot) -> None:
        """Unlink `unit` and everything below it (a loop: a 262k-token path is 1024 blocks deep,
        past Python's recursion limit)."""
        below = [unit]
        while below:
            unit = below.pop()
            if isinstance(unit, _Snapshot):
                del unit.node.snapshots[unit.tail]
                _release(unit.target_tail, unit.draft_tail)
            else:
                below += [*unit.children.values(), *unit.snapshots.values()]
                del unit.parent.children[unit.tokens]
                _release(unit.target, unit.draft)
            self.used_bytes -= unit.nbytes
            del self._lru[id(unit)]

    def _prune(self, node: _Block, protect: set[int]) -> None:
        """Drop `node` and its ancestors while they lead to no snapshot (hybrid targets)."""
        while (
            node is not self._root
            and not node.children
            and not node.snapshots
            and id(node) not in protect
        ):
            parent = node.parent
            self._drop(node)
            node = parent
