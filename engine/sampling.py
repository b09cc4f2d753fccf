"""The target's choice of token at each position: argmax at temperature 0, else a seeded sample.

Speculative decoding stays lossless because every committed token is exactly this choice,
made at the token's own position given its own path (see engine/tree.py's walk).
"""

from __future__ import annotations

import torch


def make_generator(device: torch.device, seed: int | None) -> torch.Generator:
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def choose(
    logits: torch.Tensor,  # [T, V] float32
    temperature: float,
    generator: torch.Generator | None = None,
) -> torch.Tensor:  # [T] int64
    """argmax when temperature is 0, else one sample per row from softmax(logits / temperature)."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
