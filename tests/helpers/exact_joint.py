"""The exact joint probability of a tiny target's first three output tokens, for the tests that
check speculative sampling against it (total variation of the empirical frequencies).

    exact = joint_first_three(target, prompt)                       # softmax at temperature 1
    exact = joint_first_three(target, prompt, probs=my_reference)   # any per-step rule

`probs(logits, output)` gives the next token's distribution [V] from the target's logits [V]
given the output tokens before it: the reference rule (mask, penalties, warps) under test.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

Rule = Callable[[torch.Tensor, list[int]], torch.Tensor]


def softmax_rule(logits: torch.Tensor, output: list[int]) -> torch.Tensor:
    return torch.softmax(logits.double(), dim=-1)


def joint_first_three(
    target, prompt: list[int], probs: Rule = softmax_rule
) -> dict[tuple[int, int, int], float]:
    """Exact P(t1, t2, t3) of the target's first three tokens under `probs`."""
    cache = target.new_cache(len(prompt) + 2)
    logits, _ = target.forward(torch.tensor(prompt), cache)
    target.commit(cache, torch.arange(len(prompt)))
    first = probs(logits[-1], [])
    vocab = first.shape[0]
    joint = {}
    for t1 in range(vocab):
        if first[t1] == 0:
            continue
        for t2 in range(vocab):
            pending, _ = target.forward(torch.tensor([t1, t2]), cache)  # not committed
            second = probs(pending[0], [t1])
            if second[t2] == 0:
                continue
            third = probs(pending[1], [t1, t2])
            for t3 in range(vocab):
                if third[t3] > 0:
                    joint[(t1, t2, t3)] = float(first[t1] * second[t2] * third[t3])
    return joint


def total_variation(counts: dict[tuple[int, ...], int], exact: dict[tuple, float]) -> float:
    runs = sum(counts.values())
    keys = set(counts) | set(exact)
    return 0.5 * sum(abs(counts.get(k, 0) / runs - exact.get(k, 0.0)) for k in keys)


def sampling_noise(exact: dict[tuple, float], runs: int) -> float:
    """The total variation that sampling noise alone gives, expected, at `runs` draws."""
    return 0.5 * sum(math.sqrt(2 * p * (1 - p) / (math.pi * runs)) for p in exact.values())
