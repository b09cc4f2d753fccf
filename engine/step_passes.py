"""A scheduler's plain steps as static passes, one per bucket, captured as CUDA graphs on CUDA.

A plain step is a batched step whose every sequence verifies its bonus token alone: `ar`
sequences, and `auto` ones while drafting does not pay (what a busy server runs most). Its
target pass is `forward_steps` over `StepInputs` of S rows, S the bucket: the power of two at or
above the step's sequences (1, 2, 4, ... up to the server's `--max-num-seqs`), so a server
captures a bounded set, once each, for its life. Each step fills the bucket's device buffers
with one copy from the host (tokens, positions, pool slots, committed lengths, GDN state slots,
block tables at their full width: the slots' `max_len`), then runs the pass, as the graph's
replay on CUDA (its first step runs it eagerly, then captures it: the GDN states it commits
are stepped once), else eagerly. Its outputs are `forward_batch`'s: each row's logits and the
kept layers' rows, K/V stored pending (commit advances past them). A one-token step's path
can only be [0], so the GDN states are committed by the pass itself, layer by layer
(gated_deltanet `steps_at`; each cache's pending says `INSTALLED`).

Rows past the step's sequences (padding) store their K/V in the pool's padding block
(`KVBlockPool.padding_block`) and attend over it alone; they step the first row's GDN state
slot, which the first row then writes again. Their outputs are dropped. A pass is made again
when the pool's storage moved (on the CPU it grows by doubling), or for another table width or
kept layers.

Memory: per bucket, its buffers (S * (5 + W) int64s: 4 KiB at S = 16 and 32k-token slots).
On CUDA the graphs share one memory pool, so what they hold is the largest bucket's pass, one
layer's activations at a time: at Qwen3.6-27B in bf16 and S = 16, a GDN layer's states of
the rows (3.06 MiB a row: 49 MiB), the logits (16 x 248,320 float32s: 15.2 MiB) and the kept
layers' rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from engine.decode import StaticPass
from engine.kv_blocks import PagedKVCache, PagedSequences, shared_pool
from engine.models.common import BatchOutputs, Segment, StepInputs
from engine.models.gated_deltanet import INSTALLED, shared_slots
from engine.transfer import staged

FIELDS = 5  # ids, positions, pending, prefixes, states: the buffer's first S * FIELDS values


class StepPasses:
    """The static passes of `target`'s plain steps, by (bucket, table width, kept layers)."""

    def __init__(self, target, graphs: bool) -> None:
        self.target, self.graphs = target, graphs
        self.device = target.embed_tokens.weight.device
        self._passes = PassesByStorage()
        # On CUDA the graphs share one memory pool (the tree steps' too: engine/tree_passes.py):
        # one step replays at a time, and what it leaves is read before the next (the kept
        # layers' rows are copied out).
        self.memory = torch.cuda.graph_pool_handle() if graphs else None

    def takes(self, segments: Sequence[Segment]) -> bool:
        """Whether `segments` are a plain step these passes run: one token each, verified (not
        a prefill piece), their K/V blocks of one pool and (hybrid) their states of one set of
        slots."""
        if not all(s.ids.shape[0] == 1 and not s.extend for s in segments):
            return False
        return on_shared_blocks(segments)

    def run(
        self, bonuses: list[int], segments: Sequence[Segment], hidden_layers: Sequence[int]
    ) -> BatchOutputs:
        """The step of `segments` (`takes`), each its sequence's bonus token `bonuses[i]`."""
        logits, hidden = self.filled(bonuses, segments, hidden_layers)()
        count = len(segments)
        for segment in segments:
            if states := states_of(segment.cache):  # committed by the pass (`steps_at`)
                segment.cache.pending = [INSTALLED] * len(states)
        kept = None
        if hidden is not None:  # kept by the sequences past this step: a replay reuses its own
            kept = hidden[:count].clone() if self.graphs else hidden[:count]
        rows = [slice(i, i + 1) for i in range(count)]
        return BatchOutputs([logits[i : i + 1] for i in range(count)], kept, rows)

    def filled(
        self, bonuses: list[int], segments: Sequence[Segment], hidden_layers: Sequence[int]
    ) -> StaticPass:
        """The step's bucket's pass, its buffers holding the step's values (sent, not waited
        for): calling it runs the step."""
        caches = [segment.cache for segment in segments]
        kv = [kv_of(cache) for cache in caches]
        for cache in kv:
            cache.check_room(1)
        pool, width = kv[0].pool, max(cache.table.shape[0] for cache in kv)
        bucket = sequences_bucket(len(caches))
        padding = pool.padding_block() if bucket > len(caches) else 0  # (the storage settled)
        layers = tuple(hidden_layers)
        build = lambda: self._build(bucket, width, layers, pool, caches[0])  # noqa: E731
        step = self._passes.get((bucket, width, layers), pool, build)
        host = staged(_host_buffer(bonuses, kv, caches, bucket, width, padding), self.device)
        step.buffers["flat"].copy_(host, non_blocking=True)
        return step

    def _build(self, S: int, width: int, layers: tuple, pool, cache) -> StaticPass:
        flat = torch.zeros(S * (FIELDS + width), dtype=torch.long, device=self.device)
        ids, positions, pending, prefixes, states = flat[: S * FIELDS].view(FIELDS, S)
        tables = flat[S * FIELDS :].view(S, width)
        starts = torch.arange(S + 1, device=self.device)
        layout = PagedSequences(pending, tables, starts, prefixes, None)
        slots = tuple(state.slots for state in states_of(cache))
        inputs = StepInputs(ids, positions, layout, pool, states, slots)
        run = lambda: self.target.forward_steps(inputs, layers)  # noqa: E731
        return StaticPass(run, {"flat": flat}, self.graphs, self.memory, commits=True)


class PassesByStorage:
    """Static passes by key, over one KV block pool: all made again when its storage moved
    (on the CPU it grows by doubling), as every pass read the old storage, or when the
    `arena` their outputs are held in did (`KeptArena`)."""

    def __init__(self, arena: KeptArena | None = None) -> None:
        self._passes: dict[tuple, Any] = {}
        self._storage: tuple | None = None  # the storage the passes were made over
        self.arena = arena

    def get(self, key: tuple, pool, build: Callable[[], Any]) -> Any:
        storage = (pool.k.data_ptr(), self.arena.generation if self.arena else 0)
        if storage != self._storage:
            self._passes.clear()
            self._storage = storage
        if key not in self._passes:
            self._passes[key] = build()
        return self._passes[key]


def sequences_bucket(count: int, most: int | None = None) -> int:
    """The rows a static step of `count` sequences runs in: the power of two at or above it,
    at most `most` (a server's --max-num-seqs: a wider bucket would only pad)."""
    bucket = 1 << max(0, count - 1).bit_length()
    return bucket if most is None else min(bucket, most)


ALIGN = 256  # bytes: where each tensor a `KeptArena` holds starts


class KeptArena:
    """One device buffer that every bucket of a kind of static pass writes its large outputs
    into, as views in order (a tree step's GDN factors: engine/tree_passes.py), so the buckets
    share that memory instead of each capture holding its own: one step replays at a time and
    what it leaves is read before the next (its commit). Sized for the largest bucket so far:
    it grows (doubling) in the run before a capture, never under one; `generation` counts the
    growths, and the passes over an older buffer are made again (`PassesByStorage`)."""

    def __init__(self, device: torch.device) -> None:
        self.storage = torch.empty(0, dtype=torch.uint8, device=device)
        self.generation = 0
        self._offset = 0

    def begin(self) -> None:
        """A pass starts: its outputs are laid from the buffer's start."""
        self._offset = 0

    def hold(self, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """Copies of `tensors` in the buffer, after the pass's earlier ones."""
        held = []
        for tensor in tensors:
            start = -(-self._offset // ALIGN) * ALIGN
            self._offset = start + tensor.numel() * tensor.element_size()
            if self._offset > self.storage.numel():
                self._grow(self._offset)
            view = self.storage[start : self._offset].view(tensor.dtype).view(tensor.shape)
            held.append(view.copy_(tensor))
        return tuple(held)

    def _grow(self, needed: int) -> None:
        if self.storage.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("a kept arena cannot grow while a CUDA graph is captured")
        size = max(needed, 2 * self.storage.numel())
        self.storage = torch.empty(size, dtype=torch.uint8, device=self.storage.device)
        self.generation += 1


def on_shared_blocks(segments: Sequence[Segment]) -> bool:
    """Whether the segments' K/V blocks are of one pool and (a hybrid target's) their GDN
    states slots of one set: what a static step's buffers index."""
    kv = [kv_of(segment.cache) for segment in segments]
    if shared_pool(kv) is None and not (len(kv) == 1 and isinstance(kv[0], PagedKVCache)):
        return False
    states = [states_of(segment.cache) for segment in segments]
    return not states[0] or shared_slots([mine[0] for mine in states]) is not None


def kv_of(cache) -> PagedKVCache:
    """A target cache's K/V (a hybrid cache holds them beside its GDN states)."""
    return getattr(cache, "kv", cache)


def states_of(cache) -> list:
    """A target cache's GDN states, one a layer (none: a dense target's)."""
    return getattr(cache, "recurrent", [])


def _host_buffer(
    bonuses: list[int], kv: list[PagedKVCache], caches: list, bucket: int, width: int, padding: int
) -> np.ndarray:
    """The step's values in the bucket's buffer layout: [ids, positions, pending slots,
    prefixes, state slots] x bucket, then the tables [bucket, width]; a padding row is token 0
    at position 0 of the `padding` block, the first row's state slot."""
    block = kv[0].pool.block_tokens
    fields = np.zeros((FIELDS, bucket), np.int64)
    tables = np.zeros((bucket, width), np.int64)
    for row, (bonus, cache, whole) in enumerate(zip(bonuses, kv, caches, strict=True)):
        length = cache.length
        pending = cache.blocks[length // block] * block + length % block
        state = states_of(whole)[0].index if states_of(whole) else 0
        fields[:, row] = (bonus, length, pending, length, state)
        tables[row, : len(cache.blocks)] = cache.blocks
    count = len(kv)
    fields[2, count:], fields[4, count:] = padding * block, fields[4, 0]
    tables[count:, 0] = padding
    return np.concatenate([fields.reshape(-1), tables.reshape(-1)])
