"""A scheduler's tree steps as static passes, one per bucket, captured as CUDA graphs on CUDA.

A tree step is a batched step of verify rounds, some with a tree (`ddtree`, a `linear` chain,
`auto`'s drafted ones), the rest their bonus alone, and no prefill piece: what a server of
drafting sequences runs most. At Qwen3.6-27B an eager one dispatches ~8,000 ops (host work
about as long as the GPU's own: engine/NOTES.md, session 27); replayed, it is one launch. Its
target pass is `forward_trees` over `StepInputs` of S trees of W nodes (`StaticTrees`), S the
power of two at or above the step's sequences but never past `--max-num-seqs` (a wider bucket
would only pad: its memory past the plan's), W the power of two at or above its widest verify
(2 up to MAX_WIDTH): a server captures a bounded set, each once.

Each tree is padded to W nodes by leaves under its root (token 0 at depth 1): they see the root
and themselves, no node of the tree sees them, and they come after its nodes, so the tree's
outputs are its own. Their K/V go to the pool's padding block (`KVBlockPool.padding_block`),
their outputs are dropped. Sequences past the step's (padding) are such a tree over the
padding block, reading the first sequence's GDN state slot. Nothing is committed by the pass:
K/V stay pending at the sequences' own slots and each GDN layer keeps its conv rows and its
stacked solve's factors (the graph's outputs). The step's outputs commit by the bucket's own
commit pass, a second graph replayed before the next step: from those and the trees' ends
(tree, last accepted node, state slot: one copy) it builds every state after its path and
writes it at its slot (gated_deltanet `commit_trees_at`); the K/V are moved as after any pass
(`commit_paths`). Each step fills its bucket's buffers with two copies from the host (tokens,
positions, pool slots, committed lengths, state slots, block tables, conv windows; the trees'
masks); a tree step has no host read.

Memory: per bucket, its buffers (S * (W * (3 + K) + 2 + T) int64s and S * W * W bools, T the
table width: 37 KiB at S = 16, W = 16 and 32k-token slots). On CUDA the graphs share the plain
steps' memory pool, which holds one pass's activations at a time. A capture holds its outputs
for its life, so the large ones are not each bucket's own: the logits are made after the
replay, outside the graph (held by every bucket, at Qwen3.6-27B they would be S * W x 248,320
float32s each: 242.5 MiB at S = 16, W = 16), and the GDN layers' kept factors and conv rows are
copied, layer by layer, into one `KeptArena` every bucket shares, sized for the largest so far
(58.9 MB a tree of 16 at Qwen3.6-27B: 942 MB at S = 16, within the memory plan's verify share
of 91.2 MiB a sequence; each bucket's own would be ~1.8 GB over S = 1..16 at W = 16).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from engine.decode import StaticPass
from engine.kv_blocks import PagedKVCache, PagedSequences, commit_paths
from engine.models.common import BatchOutputs, Segment, StepInputs, segment_parents
from engine.models.gated_deltanet import StaticTrees, TreeEnds, trees_taps
from engine.models.qwen3_5 import check_root_to_node_path
from engine.step_passes import (
    KeptArena,
    PassesByStorage,
    kv_of,
    on_shared_blocks,
    sequences_bucket,
    states_of,
)
from engine.transfer import staged
from engine.tree import depths_and_mask

MAX_WIDTH = 64  # the widest verify a tree step's pass takes (wider ones run eagerly)
NODE_FIELDS = 3  # ids, positions, pending slots: the buffer's first S * W * NODE_FIELDS values
TREE_FIELDS = 2  # prefixes, state slots


class TreePasses:
    """The static passes of `target`'s tree steps, by (bucket, width, table width, layers)."""

    def __init__(self, target, graphs: bool, memory=None, most: int | None = None) -> None:
        self.target, self.graphs, self.memory = target, graphs, memory
        self.most = most  # the widest bucket: the server's --max-num-seqs
        self.device = target.embed_tokens.weight.device
        self.kernel = getattr(target.config, "linear_conv_kernel_dim", 0) if _hybrid(target) else 0
        self.arena = KeptArena(self.device)  # the buckets' GDN factors, shared
        self._passes = PassesByStorage(self.arena)

    def takes(self, segments: Sequence[Segment]) -> bool:
        """Whether `segments` are a tree step these passes run: verify rounds only, one with
        a tree, none wider than MAX_WIDTH, each with room in its block table for a full-width
        verify, on `on_shared_blocks`."""
        counts = [segment.ids.shape[0] for segment in segments]
        if any(segment.extend for segment in segments) or not 1 < max(counts) <= MAX_WIDTH:
            return False
        if not on_shared_blocks(segments):
            return False
        width = _width(max(counts))
        return all(_room(kv_of(segment.cache)) >= width for segment in segments)

    @torch.no_grad()
    def run(
        self, ids: list[np.ndarray], segments: Sequence[Segment], hidden_layers: Sequence[int]
    ) -> BatchOutputs:
        """The step of `segments` (`takes`), `ids[i]` segment i's tokens on the host: each
        verify left pending for the outputs' `commit`."""
        caches = [segment.cache for segment in segments]
        parents = [segment_parents(segment) for segment in segments]
        bucket = self.filled(ids, parents, caches, hidden_layers)
        last, hidden, kept = bucket.verify()
        logits = self.target.logits(last)  # outside the graph: no bucket holds its own
        bucket.kept[:] = [kept]
        width = bucket.inputs.trees.visible.shape[1]
        rows = [slice(i * width, i * width + len(tree)) for i, tree in enumerate(parents)]
        if hidden is not None and self.graphs:  # kept by the sequences: a replay reuses its own
            hidden = hidden.clone()
        commit = partial(self.commit, bucket, caches, parents)
        return BatchOutputs([logits[r] for r in rows], hidden, rows, commit)

    def commit(
        self, bucket: _Bucket, caches: list, parents: list[np.ndarray], commits: list
    ) -> None:
        """The step's `commits` ((cache, accepted path) of its sequences): paths checked
        against their trees, the GDN states by the bucket's commit pass, the K/V moved."""
        rows = {id(cache): row for row, cache in enumerate(caches)}
        for cache, path in commits:
            check_root_to_node_path(parents[rows[id(cache)]].tolist(), path)
        if commits and bucket.commit is not None:
            bucket.fill_ends([(rows[id(cache)], path[-1], cache) for cache, path in commits])
            bucket.commit()
        commit_paths([kv_of(cache) for cache, _ in commits], [path for _, path in commits])

    def filled(
        self,
        ids: list[np.ndarray],
        parents: list[np.ndarray],
        caches: list,
        hidden_layers: Sequence[int],
    ) -> _Bucket:
        """The step's bucket, its buffers holding the step's values (sent, not waited for):
        calling its `verify` runs the step."""
        kv = [kv_of(cache) for cache in caches]
        for cache, tokens in zip(kv, ids, strict=True):
            cache.check_room(len(tokens))
        pool, table = kv[0].pool, max(cache.table.shape[0] for cache in kv)
        count, W = len(caches), _width(max(len(tokens) for tokens in ids))
        S = sequences_bucket(count, self.most)
        padding = pool.padding_block()
        key = (S, W, table, tuple(hidden_layers))
        build = lambda: self._build(S, W, table, key[3], pool, caches[0])  # noqa: E731
        bucket = self._passes.get(key, pool, build)
        host = _Host(S, W, table, pool.block_tokens, padding)
        for row, (tokens, tree, cache, whole) in enumerate(
            zip(ids, parents, kv, caches, strict=True)
        ):
            states = states_of(whole)
            slot = states[0].index if states else 0
            host.put(row, tokens, tree, cache.length, cache.blocks, slot)
        flat, visible = host.buffers(count, self.kernel)
        buffers = bucket.verify.buffers
        buffers["flat"].copy_(staged(flat, self.device), non_blocking=True)
        buffers["visible"].copy_(staged(visible, self.device), non_blocking=True)
        return bucket

    def _build(self, S: int, W: int, table: int, layers: tuple, pool, cache) -> _Bucket:
        nodes, K = S * W, self.kernel
        flat = torch.zeros(
            nodes * NODE_FIELDS + S * TREE_FIELDS + S * table + nodes * K,
            dtype=torch.long,
            device=self.device,
        )
        visible = torch.zeros(nodes * W, dtype=torch.bool, device=self.device)
        ids, positions, pending = flat[: nodes * NODE_FIELDS].view(NODE_FIELDS, nodes)
        at = nodes * NODE_FIELDS
        prefixes, states = flat[at : at + S * TREE_FIELDS].view(TREE_FIELDS, S)
        at += S * TREE_FIELDS
        tables = flat[at : at + S * table].view(S, table)
        taps = flat[at + S * table :].view(nodes, K)
        starts = torch.arange(0, nodes + 1, W, device=self.device)
        layout = PagedSequences(pending, tables, starts, prefixes, visible.view(nodes, W))
        slots = tuple(state.slots for state in states_of(cache))
        trees = StaticTrees(visible.view(S, W, W), taps, self.arena)
        inputs = StepInputs(ids, positions, layout, pool, states, slots, trees)
        run = partial(self._verify, inputs, layers)
        verify = StaticPass(run, {"flat": flat, "visible": visible}, self.graphs, self.memory)
        bucket = _Bucket(
            verify, inputs, None, [], torch.zeros(3 * S, dtype=torch.long, device=self.device)
        )
        if slots:  # a hybrid target's GDN states, built from what its verify kept
            ends = TreeEnds(*bucket.ends.view(3, S))
            commit = lambda: self.target.commit_trees(inputs, bucket.kept[0], ends)  # noqa: E731
            buffers = {"ends": bucket.ends}
            bucket.commit = StaticPass(commit, buffers, self.graphs, self.memory, commits=True)
        return bucket

    def _verify(self, inputs: StepInputs, layers: tuple) -> tuple:
        self.arena.begin()
        return self.target.forward_trees(inputs, layers)


@dataclass
class _Bucket:
    """A bucket's tree step: its `verify` pass over its `inputs` (the buffers' views), and a
    hybrid target's `commit` pass, which reads what the verify `kept` (its last outputs: on
    CUDA the graph's, at the same addresses every replay) and the trees' ends (`fill_ends`)."""

    verify: StaticPass
    inputs: StepInputs
    commit: StaticPass | None
    kept: list  # one entry: every GDN layer's kept tensors, from the last verify
    ends: torch.Tensor  # [3 * S] the commit's TreeEnds: trees, lasts, slots

    def fill_ends(self, ends: list[tuple[int, int, object]]) -> None:
        """The commit's buffer, from each commit's (tree row, last node, cache); rows past
        them repeat the first."""
        S = self.ends.shape[0] // 3
        host = np.zeros((3, S), np.int64)
        for j, (row, last, cache) in enumerate(ends):
            host[:, j] = (row, last, states_of(cache)[0].index)
        host[:, len(ends) :] = host[:, :1]
        self.ends.copy_(staged(host.reshape(-1), self.ends.device), non_blocking=True)


class _Host:
    """A tree step's values in its bucket's buffer layout, filled a sequence at a time: its
    rows' tokens, positions and pool slots (a padding node's in the `padding` block), its
    committed length, state slot and block table, its padded tree. Rows past the step's
    sequences (padding) are a tree of token 0 at position 0 over the `padding` block, at the
    first sequence's state slot."""

    def __init__(self, S: int, W: int, table: int, block: int, padding: int) -> None:
        self.W, self.block, self.padding = W, block, padding
        self.nodes = np.zeros((NODE_FIELDS, S, W), np.int64)
        self.fields = np.zeros((TREE_FIELDS, S), np.int64)
        self.tables = np.zeros((S, table), np.int64)
        self.visible = np.zeros((S, W, W), bool)
        self.trees: list[np.ndarray] = []

    def put(
        self, row: int, tokens, parents: np.ndarray, length: int, blocks: list[int], state: int
    ) -> None:
        T, W, block = len(parents), self.W, self.block
        padded = np.concatenate([parents, np.zeros(W - T, np.int64)])  # leaves under the root
        depths, self.visible[row] = depths_and_mask(padded)
        slots = length + np.arange(T)
        pending = np.asarray(blocks)[slots // block] * block + slots % block
        spare = self.padding * block + np.arange(W - T) % block
        self.nodes[:, row] = (np.pad(tokens, (0, W - T)), length + depths, [*pending, *spare])
        self.fields[:, row] = (length, state)
        self.tables[row, : len(blocks)] = blocks
        self.trees.append(padded)

    def buffers(self, count: int, kernel: int) -> tuple[np.ndarray, np.ndarray]:
        """The flat int64 buffer and the masks, padding rows filled past `count`."""
        for row in range(count, self.nodes.shape[1]):
            self.put(row, [0], np.array([-1]), 0, [self.padding], self.fields[1, 0])
        taps = trees_taps(self.trees, kernel) if kernel else np.zeros(0, np.int64)
        parts = (self.nodes, self.fields, self.tables, taps)
        return np.concatenate([part.reshape(-1) for part in parts]), self.visible.reshape(-1)


def _width(tokens: int) -> int:
    """The tree width a verify of `tokens` runs in: the power of two at or above it."""
    return 1 << max(1, (tokens - 1).bit_length())


def _room(cache: PagedKVCache) -> int:
    """The most pending tokens a static pass may read past `cache`'s committed ones: its
    block table's reach (a padding node's row reads its own slot there)."""
    return cache.table.shape[0] * cache.pool.block_tokens - cache.length


def _hybrid(target) -> bool:
    return hasattr(target, "commit_trees")
