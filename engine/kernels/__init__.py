"""Kernels: Triton on CUDA, plain torch on CPU, the references (the spec) on request.

Two families: the tree kernels (attention, gated delta rule, causal conv1d over a tree of
pending tokens) and the fused layer pieces (RMSNorm with or without the residual add before it,
RoPE, SiLU-multiply), each one launch on CUDA where plain torch makes several.

Import the dispatching names from here: `from engine.kernels import tree_attention`. Each call
picks its backend from its first tensor argument:

- a CUDA tensor, triton importable and DDOPS_KERNELS unset or "auto": the Triton kernel
  (engine/kernels/triton_*.py, imported on first use);
- any other tensor under "auto" (CPU tensors always): engine/kernels/batched.py, plain torch
  that handles a whole tree in a fixed number of calls (the reference loops over tokens); the
  fused pieces' plain torch is their reference itself, so the CPU computes what it always did;
- a fused piece whose inputs need gradients (training): the reference, which autograd can
  differentiate (the Triton versions have no backward);
- DDOPS_KERNELS=reference: engine/kernels/reference.py, the specification, everywhere.

The Triton modules are imported lazily so that a process can set TRITON_INTERPRET=1 before
they are defined (the CPU tests do) and CPU-only processes never import triton at all.
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Callable
from types import ModuleType
from typing import Any

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


def _fused_implementation(*tensors: torch.Tensor) -> ModuleType:
    if _fused_backend(tensors[0]) != "triton" or _needs_grad(tensors):
        return reference
    return importlib.import_module("engine.kernels.triton_fused")


def _fused_backend(tensor: torch.Tensor) -> str:
    """`backend_for`, without reading the environment for a CPU tensor: there a fused piece
    runs its reference under any DDOPS_KERNELS, and it runs several times a layer."""
    return backend_for(tensor) if tensor.is_cuda else "reference"


def _needs_grad(tensors: tuple[torch.Tensor, ...]) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def tree_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [S, Hkv, D], S >= prefix_len + T
    v: torch.Tensor,  # [S, Hkv, D]
    prefix_len: int | torch.Tensor,
    tree_visible: torch.Tensor | None,  # [T, T] bool, None = causal
    scale: float,
    mask: torch.Tensor | None = None,  # [T, S] a pass's `pass_mask`, for every layer
) -> torch.Tensor:  # [T, Hq, D]
    """See `reference.tree_attention`. `mask`, when given, is `pass_mask` of these arguments
    (the CPU's attention adds it instead of building it again)."""
    impl = _implementation("triton_attention", q)
    if impl is batched:
        return batched.tree_attention(q, k, v, prefix_len, tree_visible, scale, mask)
    return impl.tree_attention(q, k, v, prefix_len, tree_visible, scale)


def pass_mask(
    q: torch.Tensor,  # [T, Hq, D] a layer's queries
    keys: int,  # the keys S every layer of the pass reads
    prefix_len: int | torch.Tensor,
    tree_visible: torch.Tensor | None,  # [T, T] bool, None = causal
) -> torch.Tensor | None:  # [T, keys]
    """The mask `tree_attention` attends a pass's queries under at every layer, made once for
    the pass where the backend takes one (the CPU's, `batched.key_mask`); None elsewhere (the
    kernels read prefix_len and tree_visible) and for a causal pass."""
    if tree_visible is None or _implementation("triton_attention", q) is not batched:
        return None
    return batched.key_mask(q.shape[0], keys, prefix_len, tree_visible, q.dtype, q.device)


def paged_tree_attention(
    q: torch.Tensor,  # [N, Hq, D] the pending tokens of B sequences, concatenated
    k_blocks: torch.Tensor,  # [blocks, block_tokens, Hkv, D] one layer of a KV block pool
    v_blocks: torch.Tensor,  # [blocks, block_tokens, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int64
    query_starts: torch.Tensor,  # [B + 1] int64
    prefix_lens: torch.Tensor,  # [B] int64
    tree_visible: torch.Tensor | None,  # [N, Tmax] bool, None = causal
    scale: float,
) -> torch.Tensor:  # [N, Hq, D]
    """See `reference.paged_tree_attention`."""
    impl = _implementation("triton_attention", q)
    return impl.paged_tree_attention(
        q, k_blocks, v_blocks, block_tables, query_starts, prefix_lens, tree_visible, scale
    )


sequence_slots = reference.sequence_slots


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


def _fused(name: str) -> Callable[..., Any]:
    """`reference.<name>` (signature and docstring) dispatched like the other kernels: its
    tensor arguments choose the backend."""
    spec = getattr(reference, name)

    @functools.wraps(spec)
    def dispatch(*args: Any, **kwargs: Any) -> Any:
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        return getattr(_fused_implementation(*tensors), name)(*args, **kwargs)

    dispatch.__module__ = __name__
    return dispatch


rms_norm = _fused("rms_norm")
add_rms_norm = _fused("add_rms_norm")
apply_rotary = _fused("apply_rotary")
silu_mul = _fused("silu_mul")


__all__ = [
    "BACKEND_ENV",
    "add_rms_norm",
    "apply_rotary",
    "backend_for",
    "chain_gated_delta_rule",
    "paged_tree_attention",
    "pass_mask",
    "rms_norm",
    "sequence_slots",
    "silu_mul",
    "tree_attention",
    "tree_causal_conv1d",
    "tree_gated_delta_rule",
]
