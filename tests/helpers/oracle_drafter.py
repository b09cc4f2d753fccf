"""A drafter that proposes from a known sequence, for the decode and tensor-parallel tests:
how deep a tree is accepted is then the test's choice, not a trained drafter's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class OracleCache:
    """The oracle's "cache": how many context tokens it has been given."""

    length: int = 0

    def reset(self) -> None:
        self.length = 0


class OracleDrafter:
    """Drafts from a known sequence: at position p the right token is sequence[p].

    `ranks[p]` says where the right token goes: 0 (top choice), 1 (second, a wrong token on
    top), or None (absent). The target hidden states it is given only advance its position.
    """

    def __init__(self, sequence: list[int], vocab: int, block_size: int = 4, ranks=None) -> None:
        self.sequence, self.vocab, self.block_size = sequence, vocab, block_size
        self.ranks = ranks or {}
        self.target_layer_ids = (0,)
        self.mask_token_id = 0

    def new_cache(self, max_len: int) -> OracleCache:
        return OracleCache()

    def draft(self, target, cache, context, bonus) -> torch.Tensor:
        cache.length += context.shape[0]
        logits = torch.zeros(self.block_size - 1, self.vocab)
        for row in range(self.block_size - 1):
            position = cache.length + 1 + row  # the bonus sits at cache.length
            if position >= len(self.sequence):
                break
            right, rank = self.sequence[position], self.ranks.get(position, 0)
            if rank == 1:
                logits[row, (right + 1) % self.vocab] = 12.0
            if rank is not None:
                logits[row, right] = 10.0 if rank else 12.0
        return logits
