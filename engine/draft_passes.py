"""A scheduler's drafts as static passes, one per bucket, captured as CUDA graphs on CUDA.

A step's drafter pass (engine/models/dflash.py `draft_batch`: every drafting sequence's new
context K/V written, then its block of B attending its own keys) is, once tree steps replay as
graphs (engine/tree_passes.py), most of what is left of a decoding step's host work: ~390 of
~490 aten ops a step of 16 ddtree:15 sequences at Qwen3.6-27B's layout (engine/NOTES.md). Here
it runs as `draft_steps` over `DraftSteps` of S sequences, each context padded to C rows: S
the power of two at or above the step's drafting sequences (at most `--max-num-seqs`), C the
power of two at or above its longest context (the tokens each committed since its last draft,
up to MAX_CONTEXT; a longer one, a prompt's after its prefill, drafts eagerly). The contexts
are gathered into the bucket's buffer on the device (one concatenation and one indexed copy);
the rest is one copy from the host (positions, pool slots, bonuses, committed lengths, block
tables).

Padding context rows store their K/V in the draft pool's padding block; so do padding
sequences (past the step's), whose blocks attend over it alone. A sequence's block is stored
pending at its own slots after its context, as `draft_batch` leaves it. The drafts of the
padding sequences are dropped.

Memory: per bucket, its buffers (S * (2C + 3B + 1 + T) int64s, T the table width, and S * C
feature rows: at Qwen3.6-27B, five taps of 5,120 in bf16, 50 KiB a row, 12.5 MiB at S = 16,
C = 16). On CUDA the graphs share the steps' memory pool; each holds its output, the blocks'
last rows (S x (B-1) x 5,120 bf16s at Qwen3.6-27B: 2.3 MiB at S = 16), whose logits are made
after the replay, outside the graph: held by every bucket, they would be S x (B-1) x 248,320
float32s each (227 MiB at S = 16; ~3 GiB over the 35 buckets of S and C).
"""

from __future__ import annotations

import numpy as np
import torch

from engine.decode import StaticPass
from engine.kv_blocks import PagedKVCache, PagedSequences, shared_pool
from engine.models.dflash import DraftSteps
from engine.step_passes import PassesByStorage, sequences_bucket
from engine.transfer import staged, to_device

MAX_CONTEXT = 64  # the most context rows a sequence's static draft takes (more: eagerly)
FIELDS = ("context_positions", "context_slots", "ids", "positions", "pending")


class DraftPasses:
    """The static passes of `drafter`'s batched drafts, by (bucket, context width, table
    width)."""

    def __init__(self, drafter, target, graphs: bool, memory=None, most: int | None = None) -> None:
        self.drafter, self.target, self.graphs, self.memory = drafter, target, graphs, memory
        self.most = most  # the widest bucket: the server's --max-num-seqs
        self.device = drafter.fc.weight.device
        self._passes = PassesByStorage()

    def takes(self, items: list[tuple[PagedKVCache, torch.Tensor | None, int]]) -> bool:
        """Whether the drafts of `items` ((cache, context, bonus) each) run here: a drafter
        without sliding windows, block tables over one pool, contexts of 1 to MAX_CONTEXT
        rows."""
        caches = [cache for cache, _, _ in items]
        if not self.drafter.static_ok or not isinstance(caches[0], PagedKVCache):
            return False
        if len(caches) > 1 and shared_pool(caches) is None:
            return False
        rows = [0 if context is None else context.shape[0] for _, context, _ in items]
        return 0 < min(rows) and max(rows) <= MAX_CONTEXT

    @torch.no_grad()
    def run(self, items: list[tuple[PagedKVCache, torch.Tensor, int]]) -> torch.Tensor:
        """The drafter's logits [n, B-1, V] after each item's bonus (`takes`); each cache's
        context committed, its block left pending, as `draft_batch` leaves them."""
        drafted = self.filled(items)()
        for cache, context, _ in items:
            cache.length += context.shape[0]
        return self.drafter.logits(self.target, drafted[: len(items)])

    def filled(self, items: list[tuple[PagedKVCache, torch.Tensor, int]]) -> StaticPass:
        """The drafts' bucket's pass, its buffers holding their values (sent, not waited for):
        calling it runs the drafts."""
        B = self.drafter.block_size
        caches = [cache for cache, _, _ in items]
        contexts = [context for _, context, _ in items]
        for cache, context in zip(caches, contexts, strict=True):
            cache.check_room(context.shape[0] + B)
        pool, table = caches[0].pool, max(cache.table.shape[0] for cache in caches)
        count, C = len(items), _width(max(context.shape[0] for context in contexts))
        S = sequences_bucket(count, self.most)
        padding = pool.padding_block()
        key = (S, C, table)
        build = lambda: self._build(S, C, table, pool, contexts[0])  # noqa: E731
        step = self._passes.get(key, pool, build)
        mask = self.drafter.mask_token_id
        host = _host_buffer(items, (S, C, B, table), pool.block_tokens, padding, mask)
        step.buffers["flat"].copy_(staged(host, self.device), non_blocking=True)
        rows = np.concatenate([i * C + np.arange(x.shape[0]) for i, x in enumerate(contexts)])
        step.buffers["context"].index_copy_(0, to_device(rows, self.device), torch.cat(contexts))
        return step

    def _build(self, S: int, C: int, table: int, pool, context: torch.Tensor) -> StaticPass:
        B, device = self.drafter.block_size, self.device
        features = torch.zeros(S * C, context.shape[1], dtype=context.dtype, device=device)
        flat = torch.zeros(S * (2 * C + 3 * B + 1 + table), dtype=torch.long, device=device)
        sizes = [S * C, S * C, S * B, S * B, S * B, S, S * table]
        named = dict(zip([*FIELDS, "prefixes", "tables"], flat.split(sizes), strict=True))
        tables = named.pop("tables").view(S, table)
        starts = torch.arange(0, S * B + 1, B, device=device)
        block = torch.ones(B, B, dtype=torch.bool, device=device)
        layouts = {
            causal: PagedSequences(
                named["pending"], tables, starts, named["prefixes"], mask.repeat(S, 1)
            )
            for causal, mask in ((True, block.tril()), (False, block))
        }
        fields = {name: named[name] for name in FIELDS if name != "pending"}
        inputs = DraftSteps(features, **fields, pool=pool, layouts=layouts)
        run = lambda: self.drafter.draft_steps(self.target, inputs)  # noqa: E731
        buffers = {"flat": flat, "context": features}
        return StaticPass(run, buffers, self.graphs, self.memory)


def _host_buffer(
    items: list, shape: tuple[int, int, int, int], block: int, padding: int, mask: int
) -> np.ndarray:
    """The drafts' values in the bucket's buffer layout (`FIELDS`, the prefixes, the tables;
    `shape`: S, C, B and the table width): each sequence's context rows at its next slots
    (its padding rows' in the `padding` block), its block of the bonus then `mask` tokens
    right after them; a padding sequence's whole block at position 0 of the `padding` block."""
    S, C, B, table = shape
    rows_of = {name: C if name.startswith("context") else B for name in FIELDS}
    nodes = {name: np.zeros((S, rows_of[name]), np.int64) for name in FIELDS}
    prefixes, tables = np.zeros(S, np.int64), np.zeros((S, table), np.int64)
    spare = padding * block + np.arange(max(C, B)) % block  # slots of the padding block
    nodes["ids"][:] = mask
    for i, (cache, context, bonus) in enumerate(items):
        length, rows, blocks = cache.length, context.shape[0], np.asarray(cache.blocks)
        start = length + rows  # the bonus's position
        slots = np.arange(length, start + B)
        physical = blocks[slots // block] * block + slots % block
        nodes["context_positions"][i] = length + np.arange(C)
        nodes["context_slots"][i] = np.concatenate([physical[:rows], spare[: C - rows]])
        nodes["ids"][i, 0] = bonus
        nodes["positions"][i] = start + np.arange(B)
        nodes["pending"][i] = physical[rows:]
        prefixes[i] = start
        tables[i, : len(blocks)] = blocks
    for i in range(len(items), S):
        nodes["context_positions"][i] = np.arange(C)
        nodes["context_slots"][i] = spare[:C]
        nodes["positions"][i] = np.arange(B)
        nodes["pending"][i] = spare[:B]
        tables[i, 0] = padding
    parts = [*(nodes[name].reshape(-1) for name in FIELDS), prefixes, tables.reshape(-1)]
    return np.concatenate(parts)


def _width(rows: int) -> int:
    """The context width `rows` context rows run in: the power of two at or above them."""
    return 1 << max(0, rows - 1).bit_length()
