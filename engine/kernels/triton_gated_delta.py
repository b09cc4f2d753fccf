"""Triton kernel: the gated delta rule over a tree of pending tokens (Gated DeltaNet verify).

Matches `engine.kernels.reference.tree_gated_delta_rule` (the specification; read its
docstring for the recurrence). One program owns one head and one block of value columns of
the state [Dk, BLOCK_V], which it keeps in registers while it walks the nodes in index order
(parents precede children). When node i's parent is node i - 1 (a chain, the common case)
the state is already in registers; otherwise it is reloaded from the parent's snapshot in a
scratch buffer [T, H, Dk, Dv] (or from the initial state for a root). Only nodes that some
later node branches from are written there, unless every per-node state is asked for.

Columns of the state are independent in this recurrence (S^T k mixes rows, never columns),
which is what lets value blocks run as separate programs.

Run on CPU with TRITON_INTERPRET=1 set before this module is imported (tests do).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.reference import compute_dtype
from engine.kernels.triton_common import tl_compute_dtype


@triton.jit
def _tree_gated_delta_kernel(
    q_ptr,  # [T, H, Dk] already multiplied by the scale, in COMPUTE
    k_ptr,  # [T, H, Dk]
    v_ptr,  # [T, H, Dv]
    g_ptr,  # [T, H]
    beta_ptr,  # [T, H]
    parents_ptr,  # [T] int64
    snapshot_ptr,  # [T] int8: 1 = write this node's state to states_ptr
    init_ptr,  # [H, Dk, Dv]
    states_ptr,  # [T, H, Dk, Dv] COMPUTE scratch / per-node states
    out_ptr,  # [T, H, Dv]
    T,
    H,
    Dk,
    Dv,
    COMPUTE: tl.constexpr,  # tl.float32, or tl.float64 for float64 inputs
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    head = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)  # [BV]
    rows = tl.arange(0, BLOCK_K)  # [BK]
    row_ok = rows < Dk
    tile_ok = row_ok[:, None] & (cols < Dv)[None, :]
    tile = rows[:, None] * Dv + cols[None, :]  # [BK, BV] offsets inside one [Dk, Dv] state
    init_tile = init_ptr + head * Dk * Dv + tile
    state = tl.load(init_tile, mask=tile_ok, other=0.0).to(COMPUTE)  # [BK, BV]
    for i in range(T):
        parent = tl.load(parents_ptr + i)
        if parent != i - 1:  # branching off: fetch the parent's (or the committed) state
            if parent < 0:
                state = tl.load(init_tile, mask=tile_ok, other=0.0).to(COMPUTE)
            else:
                parent_tile = states_ptr + (parent * H + head) * Dk * Dv + tile
                state = tl.load(parent_tile, mask=tile_ok, other=0.0)
        qk_off = (i * H + head) * Dk + rows
        v_off = (i * H + head) * Dv + cols
        q = tl.load(q_ptr + qk_off, mask=row_ok, other=0.0)  # [BK]
        k = tl.load(k_ptr + qk_off, mask=row_ok, other=0.0).to(COMPUTE)  # [BK]
        v = tl.load(v_ptr + v_off, mask=cols < Dv, other=0.0).to(COMPUTE)  # [BV]
        decay = tl.exp(tl.load(g_ptr + i * H + head).to(COMPUTE))
        beta = tl.load(beta_ptr + i * H + head).to(COMPUTE)
        state = state * decay
        recalled = tl.sum(state * k[:, None], axis=0)  # [BV] = S^T k
        state = state + k[:, None] * ((v - recalled) * beta)[None, :]
        out = tl.sum(state * q[:, None], axis=0)  # [BV] = S^T (scale q)
        tl.store(out_ptr + v_off, out.to(out_ptr.dtype.element_ty), mask=cols < Dv)
        if tl.load(snapshot_ptr + i) != 0:
            tl.store(states_ptr + (i * H + head) * Dk * Dv + tile, state, mask=tile_ok)
            # A later node of this program may reload it: make the writes of every thread
            # of the block visible before that happens.
            tl.debug_barrier()


def _branch_points(parents: torch.Tensor) -> torch.Tensor:  # [T] int8
    """1 for each node that a later node other than its successor takes as parent.

    Written without boolean indexing, which would wait for the GPU (a sync per layer).
    """
    T = parents.shape[0]
    index = torch.arange(T, device=parents.device)
    branches = (parents >= 0) & (parents != index - 1)
    targets = torch.where(branches, parents, T)  # [T]; slot T collects the non-branching
    marks = torch.zeros(T + 1, dtype=torch.int8, device=parents.device)
    return marks.scatter_(0, targets, 1)[:T]


def tree_gated_delta_rule(
    q: torch.Tensor,  # [T, H, Dk]  L2-normalised
    k: torch.Tensor,  # [T, H, Dk]  L2-normalised
    v: torch.Tensor,  # [T, H, Dv]
    g: torch.Tensor,  # [T, H]      log decay (<= 0)
    beta: torch.Tensor,  # [T, H]
    parents: torch.Tensor,  # [T] int64
    initial_state: torch.Tensor,  # [H, Dk, Dv]
    scale: float,
    return_states: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Triton version of `reference.tree_gated_delta_rule`: same arguments, same results.

    Returns (o [T, H, Dv] in v's dtype, states [T, H, Dk, Dv] in `compute_dtype` or None).
    """
    T, H, Dk = q.shape
    Dv = v.shape[-1]
    compute = compute_dtype(v.dtype)
    scaled_q = (q.to(compute) * scale).contiguous()  # [T, H, Dk], exactly as the reference
    k, v, g, beta = (x.contiguous() for x in (k, v, g, beta))
    parents = parents.to(device=q.device, dtype=torch.int64).contiguous()
    initial_state = initial_state.contiguous()
    states = torch.empty(T, H, Dk, Dv, dtype=compute, device=q.device)
    out = torch.empty(T, H, Dv, dtype=v.dtype, device=q.device)
    if T == 0:
        return out, (states if return_states else None)
    if return_states:
        snapshot = torch.ones(T, dtype=torch.int8, device=q.device)
    else:
        snapshot = _branch_points(parents)
    block_k = triton.next_power_of_2(Dk)
    # A state tile of at most 4096 values: 32 registers a thread at 4 warps (fp32), and for
    # Qwen3.6 (48 heads, 128 x 128) 48 x 4 programs, more than an H200 has SMs.
    block_v = min(triton.next_power_of_2(Dv), max(16, 4096 // block_k))
    grid = (H, triton.cdiv(Dv, block_v))
    _tree_gated_delta_kernel[grid](
        scaled_q, k, v, g, beta, parents, snapshot, initial_state, states, out,
        T, H, Dk, Dv,
        COMPUTE=tl_compute_dtype(v.dtype),
        BLOCK_K=block_k, BLOCK_V=block_v,
    )  # fmt: skip
    return out, (states if return_states else None)
