"""A graph-safe stand-in for `paged_tree_attention` of equal-width sequences (tests of static
passes that compile whole: tests/engine/test_tree_passes.py, tests/engine/test_draft_passes.py):
the CPU's reference loops over the sequences on the host."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def trees_attention(q, k_blocks, v_blocks, tables, starts, prefixes, visible, scale):
    """`paged_tree_attention` of S trees of W nodes in a fixed set of calls: every tree's
    whole table gathered, its keys past its committed ones masked by its tree (graph-safe)."""
    S, width = tables.shape
    N, block = q.shape[0], k_blocks.shape[1]
    W = N // S
    slots = (tables[:, :, None] * block + torch.arange(block)).flatten(1)  # [S, width * block]
    keys, values = (x.flatten(0, 1)[slots].transpose(1, 2) for x in (k_blocks, v_blocks))
    column = torch.arange(width * block) - prefixes[:, None]  # [S, keys] past the committed
    mine = visible.view(S, W, W).gather(2, column.clamp(0, W - 1)[:, None].expand(S, W, -1))
    seen = (column < 0)[:, None] | (mine & (column < W)[:, None])  # [S, W, keys]
    mask = torch.zeros(seen.shape, dtype=q.dtype).masked_fill(~seen, float("-inf"))
    Q = q.view(S, W, *q.shape[1:]).transpose(1, 2)  # [S, Hq, W, D]
    out = F.scaled_dot_product_attention(
        Q, keys, values, mask[:, None], scale=scale, enable_gqa=True
    )
    return out.transpose(1, 2).reshape(q.shape)
