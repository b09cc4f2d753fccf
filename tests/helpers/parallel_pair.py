"""What the tensor-parallel tests share: a checkpoint whole and over two ranks (`Pair`), the
prompt and tolerance they compare at, the pass sequence they compare, and a drafter that knows
one rank's output.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from torch import nn

from engine.decode import GenerationConfig, generate
from engine.parallel import TensorParallelTarget
from tests.helpers.oracle_drafter import OracleDrafter

PROMPT = [5, 17, 3, 42, 8, 23, 11]
TOLERANCE = 1e-5


@dataclass
class Pair:
    """The same checkpoint whole (one process) and over two ranks."""

    whole: nn.Module
    sharded: TensorParallelTarget

    @property
    def vocab(self) -> int:
        return self.whole.config.vocab_size


def prefill_tree_chain(target, layers: tuple[int, ...]) -> list[torch.Tensor]:
    """Logits and hidden states of: prefill, a branching tree, its commit, then a chain."""
    cache = target.new_cache(64)
    outputs = list(target.forward(torch.tensor(PROMPT), cache, None, layers))
    target.commit(cache, torch.arange(len(PROMPT)))
    tree_ids, parents = torch.tensor([7, 8, 9, 10, 11]), torch.tensor([-1, 0, 0, 1, 3])
    outputs += target.forward(tree_ids, cache, parents, layers)
    target.commit(cache, torch.tensor([0, 1, 3, 4]))
    outputs += target.forward(torch.tensor([12, 13]), cache, None, layers)
    return outputs


def oracle_for(pair: Pair, seed: int) -> OracleDrafter:
    """A drafter that knows one rank's greedy output: often first, sometimes second, or absent."""
    cfg = GenerationConfig(method="ar", max_new_tokens=24)
    sequence = PROMPT + generate(pair.whole, None, PROMPT, cfg).output_ids
    rng = random.Random(seed)
    ranks = {p: rng.choice([0, 0, 0, 1, None]) for p in range(len(sequence))}
    return OracleDrafter(sequence, pair.vocab, block_size=5, ranks=ranks)
