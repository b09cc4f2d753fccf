"""Tree shapes and tolerances shared by the kernel tests (Triton and batched vs the references).

Tolerances: float32 1e-5 (same maths, another summation order); bf16 inputs 1.6e-2 relative,
one or two bf16 rounding steps of the output; float64 1e-12.
"""

from __future__ import annotations

import torch

TOLERANCE = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.bfloat16: {"atol": 1.6e-2, "rtol": 1.6e-2},
    torch.float64: {"atol": 1e-12, "rtol": 1e-12},
}

TREE_SHAPES = {  # parents of each node; -1: the node hangs off the committed prefix
    "single": [-1],
    "all_roots": [-1, -1, -1, -1, -1],
    "chain": [-1, 0, 1, 2, 3, 4],
    "wide": [-1, 0, 0, 0, 0, 0, 0],
    "two_level": [-1, 0, 0, 1, 1, 2, 2],
    "forest": [-1, 0, -1, 2, 1, -1, 3],
}
