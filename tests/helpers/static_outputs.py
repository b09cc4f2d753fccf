"""A static pass's outputs against its eager self: every tensor of a (nested) output, compared
(tests/engine/test_graph_safe.py, tests/engine/test_step_passes.py)."""

from __future__ import annotations

import torch


def flat(outputs) -> list[torch.Tensor]:
    """Every tensor of a (nested) pass output, in order."""
    if isinstance(outputs, torch.Tensor):
        return [outputs]
    return [t for item in outputs if item is not None for t in flat(item)]


def assert_same(compiled, eager) -> None:
    pairs = list(zip(flat(compiled), flat(eager), strict=True))
    assert pairs
    for got, want in pairs:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
