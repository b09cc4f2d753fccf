"""DDTree: build the draft tree from the drafter's per-position logits, lay it out, walk it.

Node numbering (also the `--trace` format): the verify input is [bonus root, node 1, ..., node n];
node i sits at verify index i and `parents[i-1]` is its parent's verify index (0 = root), so the
verify pass's `parents` argument is simply [-1, *tree.parents].

Tree build (DDTree, best-first under a node budget): take the top-k (k = budget) log-probs of
each draft position; a max-heap over prefixes keyed by cumulative log-prob starts at (depth 1,
rank 0); each pop adds a node, then pushes its next sibling (same depth and parent, rank + 1) and
its first child (depth + 1, rank 0). Stop at `budget` nodes. A node is always popped after its
parent, so parents precede children. Equal scores pop in push order (deterministic).

Walk (lossless at any temperature): from the root, follow the child whose token equals the
target's choice (argmax, or its sample) at the current node; the first miss is the next bonus.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class DraftTree:
    tokens: np.ndarray  # [n] int64, node tokens in build order
    parents: np.ndarray  # [n] int64, verify index of each node's parent (0 = root)

    @property
    def size(self) -> int:
        return len(self.tokens)

    def verify_parents(self) -> np.ndarray:  # [n + 1]
        return np.concatenate([[-1], self.parents]).astype(np.int64)


def chain_tree(tokens: np.ndarray) -> DraftTree:
    """A chain (DFlash linear drafting): node i's parent is node i - 1."""
    tokens = np.asarray(tokens, dtype=np.int64)
    return DraftTree(tokens, np.arange(len(tokens), dtype=np.int64))


def top_k_log_probs(logits: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-k log-probs and token ids [D, k] of logits [D, V], moved to the CPU in one copy each."""
    values, ids = torch.log_softmax(logits.float(), dim=-1).topk(min(k, logits.shape[-1]), dim=-1)
    return values.cpu().numpy(), ids.cpu().numpy()


def build_tree(log_probs: np.ndarray, token_ids: np.ndarray, budget: int) -> DraftTree:
    """Best-first tree of at most `budget` nodes from top-k log_probs / token_ids [D, k] (sorted)."""
    depth_limit, k = log_probs.shape
    tokens: list[int] = []
    parents: list[int] = []
    if budget <= 0 or depth_limit == 0:
        return DraftTree(np.zeros(0, np.int64), np.zeros(0, np.int64))
    lp = log_probs.tolist()  # Python floats: heap work stays out of numpy scalars
    ids = token_ids.tolist()
    # entries: (-cumulative log-prob, push order, depth, rank, parent verify index)
    heap = [(-lp[0][0], 0, 1, 0, 0)]
    pushed = 1
    while heap and len(tokens) < budget:
        neg_score, _, depth, rank, parent = heapq.heappop(heap)
        tokens.append(ids[depth - 1][rank])
        parents.append(parent)
        node = len(tokens)  # this node's verify index
        if rank + 1 < k:
            sibling = neg_score + lp[depth - 1][rank] - lp[depth - 1][rank + 1]
            heapq.heappush(heap, (sibling, pushed, depth, rank + 1, parent))
            pushed += 1
        if depth < depth_limit:
            heapq.heappush(heap, (neg_score - lp[depth][0], pushed, depth + 1, 0, node))
            pushed += 1
    return DraftTree(np.array(tokens, dtype=np.int64), np.array(parents, dtype=np.int64))


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
