"""Small helpers shared by the Triton kernel modules (engine/kernels/triton_*.py)."""

from __future__ import annotations

import os

import torch
import triton.language as tl

from engine.kernels.reference import compute_dtype


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def tl_compute_dtype(dtype: torch.dtype) -> tl.dtype:
    """The Triton type a kernel computes in for inputs of `dtype`, as the references do."""
    return tl.float64 if compute_dtype(dtype) == torch.float64 else tl.float32


def tl_dot_dtype(dtype: torch.dtype) -> tl.dtype:
    """The operand type for `tl.dot` on inputs of `dtype`.

    Half-precision inputs feed the tensor cores as they are; everything else runs in the
    compute type, and so does everything under the interpreter, where bf16 `tl.dot` is wrong.
    """
    if dtype in _HALF_TYPES and not interpreting():
        return _HALF_TYPES[dtype]
    return tl_compute_dtype(dtype)


_HALF_TYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
