"""Tree kernels: Triton on CUDA, batched plain torch on CPU, the references (the spec) on request.

Import the dispatching names from here: `from engine.kernels import tree_attention`. Each call
picks its backend from its first tensor argument:

- a CUDA tensor, triton importable and DDOPS_KERNELS unset or "auto": the Triton kernel
  (engine/kernels/triton_*.py, imported on first use);
- any other tensor under "auto" (CPU tensors always): engine/kernels/batched.py, plain torch
  that handles a whole tree in a fixed number of calls (the reference loops over tokens);
- DDOPS_KERNELS=reference: engine/kernels/reference.py, the specification, everywhere.

The Triton modules are imported lazily so that a process can set TRITON_INTERPRET=1 before
they are defined (the CPU tests do) and CPU-only processes never import triton at all.
"""

from __future__ import annotations

import functools
import importlib
import os
from types import ModuleType

import torch

from engine.kernels import batched, reference

BACKEND_ENV = "DDOPS_KERNELS"
_BACKEND_CHOICES = ("auto", "reference")


@functools.cache
def _triton_importable() -> bool:
    try:
        importlib.import_module("triton")
    except ImportError:
        return False
    return True


def backend_for(tensor: torch.Tensor) -> str:
    """The backend ("triton", "batched" or "reference") that calls with `tensor` first use."""
    choice = os.environ.get(BACKEND_ENV, "auto")
    if choice not in _BACKEND_CHOICES:
        raise ValueError(f"{BACKEND_ENV}={choice!r}: expected one of {', '.join(_BACKEND_CHOICES)}")
    if choice == "reference":
        return "reference"
    if tensor.is_cuda and _triton_importable():
        return "triton"
    return "batched"


def _implementation(triton_module: str, tensor: torch.Tensor) -> ModuleType:
    backend = backend_for(tensor)
    if backend == "triton":
        return importlib.import_module(f"engine.kernels.{triton_module}")
    return batched if backend == "batched" else reference


def tree_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [S, Hkv, D], S >= prefix_len + T
    v: torch.Tensor,  # [S, Hkv, D]
    prefix_len: int | torch.Tensor,
    tree_visible: torch.Tensor | None,  # [T, T] bool, None = causal
    scale: float,
) -> torch.Tensor:  # [T, Hq, D]
    """See `reference.tree_attention`."""
    impl = _implementation("triton_attention", q)
    return impl.tree_attention(q, k, v, prefix_len, tree_visible, scale)


def tree_gated_delta_rule(
    q: torch.Tensor,  # [T, H, Dk]
    k: torch.Tensor,  # [T, H, Dk]
    v: torch.Tensor,  # [T, H, Dv]
    g: torch.Tensor,  # [T, H]
    beta: torch.Tensor,  # [T, H]
    parents: torch.Tensor,  # [T] int64
    initial_state: torch.Tensor,  # [H, Dk, Dv]
    scale: float,
    return_states: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # [T, H, Dv], [T, H, Dk, Dv] | None
    """See `reference.tree_gated_delta_rule`."""
    impl = _implementation("triton_gated_delta", q)
    return impl.tree_gated_delta_rule(
        q, k, v, g, beta, parents, initial_state, scale, return_states=return_states
    )


def chain_gated_delta_rule(
    q: torch.Tensor,  # [T, H, Dk]
    k: torch.Tensor,  # [T, H, Dk]
    v: torch.Tensor,  # [T, H, Dv]
    g: torch.Tensor,  # [T, H]
    beta: torch.Tensor,  # [T, H]
    initial_state: torch.Tensor,  # [H, Dk, Dv]
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # [T, H, Dv], final state [H, Dk, Dv]
    """See `reference.chain_gated_delta_rule`."""
    impl = _implementation("triton_gated_delta", q)
    return impl.chain_gated_delta_rule(q, k, v, g, beta, initial_state, scale)


def tree_causal_conv1d(
    x: torch.Tensor,  # [T, C]
    parents: torch.Tensor,  # [T] int64
    conv_state: torch.Tensor,  # [C, W]
    weight: torch.Tensor,  # [C, K]
    bias: torch.Tensor | None,  # [C]
    activation: str | None = "silu",
) -> torch.Tensor:  # [T, C]
    """See `reference.tree_causal_conv1d`."""
    impl = _implementation("triton_conv", x)
    return impl.tree_causal_conv1d(x, parents, conv_state, weight, bias, activation)


__all__ = [
    "BACKEND_ENV",
    "backend_for",
    "chain_gated_delta_rule",
    "tree_attention",
    "tree_causal_conv1d",
    "tree_gated_delta_rule",
]
