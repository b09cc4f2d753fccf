"""DDTree: build the draft tree from the drafter's per-position logits, lay it out, walk it.

Node numbering (also the `--trace` format): the verify input is [bonus root, node 1, ..., node n];
node i sits at verify index i and `parents[i-1]` is its parent's verify index (0 = root), so the
verify pass's `parents` argument is simply [-1, *tree.parents].

Tree build (DDTree, best-first under a node budget): take the top-k (k = budget) log-probs of
each draft position; a max-heap over prefixes keyed by cumulative log-prob starts at (depth 1,
rank 0); each pop adds a node, then pushes its next sibling (same depth and parent, rank + 1) and
its first child (depth + 1, rank 0). Stop at `budget` nodes (each keeps its path's log-prob, the
key it was popped at: non-increasing, so the tree of budget k is the first k nodes of a larger
one, engine/budgets.py). A node is always popped after its
parent, so parents precede children. Equal scores pop in push order (deterministic). Under a
grammar (engine/grammar.py) a popped candidate the grammar refuses adds no node and no child,
only its sibling: the tree holds grammar-valid tokens only.

Walk (lossless at any temperature): from the root, follow the child whose token equals the
target's choice (argmax, or its sample) at the current node; the first miss is the next bonus.

On the device (`TreeInputs`): a pass's token ids, parents, depths and ancestor mask, with the
committed length, are packed on the host into one int64 array (`pack_pass`) and reach the device
in one copy; the static-shape passes (engine/decode.py) read nothing else. `padded_parents`
pads a verify to a fixed width with a chain hanging below the last node, which no real node sees
and the walk never reaches.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine.kernels.reference import cast
from engine.transfer import to_device


@dataclass
class DraftTree:
    tokens: np.ndarray  # [n] int64, node tokens in build order
    parents: np.ndarray  # [n] int64, verify index of each node's parent (0 = root)
    log_probs: np.ndarray | None = None  # [n] a best-first tree's path log-probs (non-increasing)

    @property
    def size(self) -> int:
        return len(self.tokens)

    def first(self, count: int) -> DraftTree:
        """The first `count` nodes: a best-first tree's first k are the tree of budget k."""
        log_probs = None if self.log_probs is None else self.log_probs[:count]
        return DraftTree(self.tokens[:count], self.parents[:count], log_probs)

    def verify_parents(self) -> np.ndarray:  # [n + 1]
        return np.concatenate([[-1], self.parents]).astype(np.int64)


def path_tokens(tree: DraftTree) -> list[list[int]]:
    """For each verify index (root 0 first), the node tokens on its path below the root."""
    paths: list[list[int]] = [[]]
    for parent, token in zip(tree.parents.tolist(), tree.tokens.tolist(), strict=True):
        paths.append([*paths[parent], token])
    return paths


def chain_tree(tokens: np.ndarray) -> DraftTree:
    """A chain (DFlash linear drafting): node i's parent is node i - 1."""
    tokens = np.asarray(tokens, dtype=np.int64)
    return DraftTree(tokens, np.arange(len(tokens), dtype=np.int64))


TopK = tuple[np.ndarray, np.ndarray]  # top-k log-probs and token ids [..., D, k] of draft logits


def top_k_log_probs(logits: torch.Tensor, k: int) -> TopK:
    """Top-k log-probs and token ids [..., D, k] of logits [..., D, V] (several sequences'
    drafts at once), read back in one copy (one host sync): the ids travel as float64, exact
    for any vocabulary below 2^53."""
    values, ids = torch.log_softmax(cast(logits, torch.float32), dim=-1).topk(
        min(k, logits.shape[-1]), dim=-1
    )
    both = torch.stack([values.double(), ids.double()]).cpu().numpy()  # [2, ..., D, k]
    return both[0].astype(np.float32), both[1].astype(np.int64)


def build_tree(
    log_probs: np.ndarray,
    token_ids: np.ndarray,
    budget: int,
    allow: Callable[[int, int], bool] | None = None,
) -> DraftTree:
    """Best-first tree of at most `budget` nodes from top-k log_probs / token_ids [D, k] (sorted).

    `allow(parent, token)`, when given, is asked of every candidate in the order it would join
    the tree: a refused one is skipped (no node, no children; its next sibling is still tried).
    """
    depth_limit, k = log_probs.shape
    tokens: list[int] = []
    parents: list[int] = []
    scores: list[float] = []
    if budget <= 0 or depth_limit == 0:
        return DraftTree(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0))
    lp = log_probs.tolist()  # Python floats: heap work stays out of numpy scalars
    ids = token_ids.tolist()
    # entries: (-cumulative log-prob, push order, depth, rank, parent verify index)
    heap = [(-lp[0][0], 0, 1, 0, 0)]
    pushed = 1
    while heap and len(tokens) < budget:
        neg_score, _, depth, rank, parent = heapq.heappop(heap)
        token = ids[depth - 1][rank]
        if rank + 1 < k:
            sibling = neg_score + lp[depth - 1][rank] - lp[depth - 1][rank + 1]
            heapq.heappush(heap, (sibling, pushed, depth, rank + 1, parent))
            pushed += 1
        if allow is not None and not allow(parent, token):
            continue
        tokens.append(token)
        parents.append(parent)
        scores.append(-neg_score)
        node = len(tokens)  # this node's verify index
        if depth < depth_limit:
            heapq.heappush(heap, (neg_score - lp[depth][0], pushed, depth + 1, 0, node))
            pushed += 1
    return DraftTree(
        np.array(tokens, dtype=np.int64), np.array(parents, dtype=np.int64), np.array(scores)
    )


def depths_and_mask(parents: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Depth [T] (a root, parent -1, has depth 0) and ancestor mask [T, T] of a parents array.

    mask[i, j] is True when j is i or one of i's ancestors.
    """
    T = len(parents)
    depths = np.zeros(T, dtype=np.int64)
    mask = np.zeros((T, T), dtype=bool)
    for i, p in enumerate(parents.tolist()):
        if p >= 0:
            mask[i] = mask[p]
            depths[i] = depths[p] + 1
        mask[i, i] = True
    return depths, mask


def tree_layout(
    parents: torch.Tensor | None, T: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Depths [T] and ancestor mask [T, T] on `device`; None mask for a chain (parents None)."""
    if parents is None:
        return torch.arange(T, device=device), None
    depths, mask = depths_and_mask(parents.cpu().numpy())
    return torch.from_numpy(depths).to(device), torch.from_numpy(mask).to(device)


def walk(tree: DraftTree, choices: list[int]) -> tuple[list[int], int]:
    """Accepted verify indices (root 0 first) and the next bonus token.

    `choices[i]` is the target's token at verify index i (argmax or sample given i's path).
    """
    child_of = {
        (p, t): i + 1
        for i, (p, t) in enumerate(zip(tree.parents.tolist(), tree.tokens.tolist(), strict=True))
    }
    accepted = [0]
    while (child := child_of.get((accepted[-1], choices[accepted[-1]]))) is not None:
        accepted.append(child)
    return accepted, choices[accepted[-1]]


def padded_parents(parents: np.ndarray, width: int) -> np.ndarray:
    """Verify parents [T] extended to `width` by a chain below the last node (each pad's parent
    is the index before it): a chain stays a chain, and no real node has a pad as ancestor."""
    pads = np.arange(len(parents) - 1, width - 1, dtype=np.int64)
    return np.concatenate([parents.astype(np.int64), pads])


def is_chain(parents: np.ndarray) -> bool:
    return bool(np.array_equal(parents, np.arange(-1, len(parents) - 1)))


@dataclass
class TreeInputs:
    """What a static-shape pass reads, all on the device: views of one packed int64 buffer."""

    length: torch.Tensor  # [] committed tokens before the pass
    ids: torch.Tensor  # [T]
    parents: torch.Tensor  # [T] (-1 = child of the last committed token)
    depths: torch.Tensor  # [T]
    ancestors: torch.Tensor  # [T, T] int64, 1 where j is i or one of its ancestors

    @property
    def visible(self) -> torch.Tensor:  # [T, T] bool
        # Converted at each use: a pass captured as a CUDA graph must read the buffer's values.
        return self.ancestors.bool()

    @property
    def width(self) -> int:
        return self.ids.shape[0]

    def slots(self) -> torch.Tensor:  # [T] cache slots the pass writes
        return self.length + torch.arange(self.width, device=self.ids.device)


def packed_size(width: int) -> int:
    return 1 + 3 * width + width * width


def pack_pass(ids: np.ndarray, parents: np.ndarray, length: int) -> np.ndarray:
    """[length, ids, parents, depths, ancestor mask] as one int64 array (see `unpack_pass`)."""
    depths, mask = depths_and_mask(parents)
    return np.concatenate([[length], ids, parents, depths, mask.ravel()]).astype(np.int64)


def unpack_pass(buffer: torch.Tensor, width: int) -> TreeInputs:
    """The views of a `pack_pass` buffer of a `width`-token pass (no copies, no host reads)."""
    T = width
    return TreeInputs(
        length=buffer[0],
        ids=buffer[1 : 1 + T],
        parents=buffer[1 + T : 1 + 2 * T],
        depths=buffer[1 + 2 * T : 1 + 3 * T],
        ancestors=buffer[1 + 3 * T :].view(T, T),
    )


class DevicePaths(Sequence[torch.Tensor]):
    """Paths given on the host (lists of node indices), each copied to `device` when first read
    (a batched commit builds most states from what its pass kept, without reading them)."""

    def __init__(self, paths: list[list[int]], device: torch.device) -> None:
        self.paths, self.device = paths, device
        self._on_device: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> torch.Tensor:
        if index not in self._on_device:
            self._on_device[index] = to_device(np.array(self.paths[index]), self.device)
        return self._on_device[index]
