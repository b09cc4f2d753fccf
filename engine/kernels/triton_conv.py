"""Triton kernel: depthwise causal conv1d update over a tree of pending tokens (+ SiLU).

Matches `engine.kernels.reference.tree_causal_conv1d` (the specification). One program
computes one node for one block of channels: it walks K - 1 steps up the node's path, first
through its ancestors among the pending tokens, then into the committed inputs (conv_state,
newest column first), multiplying each input by its tap of the kernel.

A step's position is one int: p >= 0 is pending token p, p < 0 is conv_state column W + p
(-1 = the newest committed input). Stepping up from pending token p goes to parents[p], which
is -1 for a root: exactly the newest committed column, so one rule covers both.

Run on CPU with TRITON_INTERPRET=1 set before this module is imported (tests do).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.triton_common import tl_compute_dtype


@triton.jit
def _tree_conv_kernel(
    x_ptr,  # [T, C]
    parents_ptr,  # [T] int64
    state_ptr,  # [C, W]
    weight_ptr,  # [C, K]
    bias_ptr,  # [C] (unused without HAS_BIAS)
    out_ptr,  # [T, C]
    C,
    W,
    K: tl.constexpr,
    COMPUTE: tl.constexpr,  # tl.float32, or tl.float64 for float64 inputs
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    node = tl.program_id(0).to(tl.int64)  # int64: T * C passes 2^31 on a long prefill
    chans = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)  # [BC]
    chan_ok = chans < C
    acc = tl.load(x_ptr + node * C + chans, mask=chan_ok, other=0.0).to(COMPUTE)
    acc = acc * tl.load(weight_ptr + chans * K + (K - 1), mask=chan_ok, other=0.0).to(COMPUTE)
    pos = node
    for tap in tl.static_range(K - 2, -1, -1):  # taps from the newest older input backwards
        up = tl.load(parents_ptr + tl.maximum(pos, 0))
        pos = tl.where(pos >= 0, up, pos - 1)
        is_pending = tl.full([BLOCK_C], 0, tl.int64) + pos >= 0  # [BC], all equal
        pending = tl.load(x_ptr + pos * C + chans, mask=chan_ok & is_pending, other=0.0)
        committed = tl.load(
            state_ptr + chans * W + (W + pos), mask=chan_ok & ~is_pending, other=0.0
        )
        tap_weight = tl.load(weight_ptr + chans * K + tap, mask=chan_ok, other=0.0)
        acc += (pending.to(COMPUTE) + committed.to(COMPUTE)) * tap_weight.to(COMPUTE)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + chans, mask=chan_ok, other=0.0).to(COMPUTE)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(out_ptr + node * C + chans, acc.to(out_ptr.dtype.element_ty), mask=chan_ok)


def tree_causal_conv1d(
    x: torch.Tensor,  # [T, C]
    parents: torch.Tensor,  # [T] int64
    conv_state: torch.Tensor,  # [C, W], W >= K - 1, oldest first
    weight: torch.Tensor,  # [C, K]
    bias: torch.Tensor | None,  # [C]
    activation: str | None = "silu",
) -> torch.Tensor:  # [T, C] in x's dtype
    """Triton version of `reference.tree_causal_conv1d`: same arguments, same result."""
    T, C = x.shape
    K = weight.shape[-1]
    W = conv_state.shape[-1]
    if W < K - 1:
        raise ValueError(f"conv_state holds {W} inputs, the kernel needs {K - 1}")
    if activation not in (None, "silu"):
        raise ValueError(f"unsupported activation {activation!r}")
    x, conv_state, weight = x.contiguous(), conv_state.contiguous(), weight.contiguous()
    parents = parents.to(device=x.device, dtype=torch.int64).contiguous()
    out = torch.empty_like(x)
    if T == 0:
        return out
    block_c = min(triton.next_power_of_2(C), 256)
    _tree_conv_kernel[(T, triton.cdiv(C, block_c))](
        x, parents, conv_state, weight, bias if bias is not None else x, out,
        C, W,
        K=K, COMPUTE=tl_compute_dtype(x.dtype),
        HAS_BIAS=bias is not None, SILU=activation == "silu", BLOCK_C=block_c,
    )  # fmt: skip
    return out
