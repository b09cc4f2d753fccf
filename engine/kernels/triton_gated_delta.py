"""Triton kernel: the gated delta rule over a tree of pending tokens (Gated DeltaNet verify).

Matches `engine.kernels.reference.tree_gated_delta_rule` (the specification; read its
docstring for the recurrence). One program owns one head and one block of value columns of
the state [Dk, BLOCK_V], which it keeps in registers while it walks the nodes in index order
(parents precede children). When node i's parent is node i - 1 (a chain, the common case)
the state is already in registers; otherwise it is reloaded from the parent's snapshot in a
scratch buffer (or from the initial state for a root). Only nodes that some later node
branches from are written there, each into its own row (`slots`), unless every per-node state
is asked for: the scratch has a row per branch point, not per token, and a chain (a prefill
chunk, `chain_gated_delta_rule`) writes only its last state. Offsets into it are int64: at
Qwen3.6 shapes one row is 48 x 128 x 128 floats, so 2^31 is passed after 2730 rows.

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
    slots_ptr,  # [T] int64: the row of states_ptr that keeps this node's state, -1 = none
    init_ptr,  # [H, Dk, Dv]
    states_ptr,  # [rows, H, Dk, Dv] COMPUTE scratch / per-node states
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
    # Token i's rows, advanced by pointer each step: i * H * Dk as an int32 product would
    # overflow on a long pass.
    qk_ptr_off, v_ptr_off, gb_off = head * Dk + rows, head * Dv + cols, head
    q_row, k_row = q_ptr + qk_ptr_off, k_ptr + qk_ptr_off
    v_row, out_row = v_ptr + v_ptr_off, out_ptr + v_ptr_off
    g_row, beta_row = g_ptr + gb_off, beta_ptr + gb_off
    for i in range(T):
        parent = tl.load(parents_ptr + i)
        if parent != i - 1:  # branching off: fetch the parent's (or the committed) state
            if parent < 0:
                state = tl.load(init_tile, mask=tile_ok, other=0.0).to(COMPUTE)
            else:
                parent_slot = tl.load(slots_ptr + parent)  # int64
                parent_tile = states_ptr + (parent_slot * H + head) * Dk * Dv + tile
                state = tl.load(parent_tile, mask=tile_ok, other=0.0)
        q = tl.load(q_row, mask=row_ok, other=0.0)  # [BK]
        k = tl.load(k_row, mask=row_ok, other=0.0).to(COMPUTE)  # [BK]
        v = tl.load(v_row, mask=cols < Dv, other=0.0).to(COMPUTE)  # [BV]
        decay = tl.exp(tl.load(g_row).to(COMPUTE))
        beta = tl.load(beta_row).to(COMPUTE)
        state = state * decay
        recalled = tl.sum(state * k[:, None], axis=0)  # [BV] = S^T k
        state = state + k[:, None] * ((v - recalled) * beta)[None, :]
        out = tl.sum(state * q[:, None], axis=0)  # [BV] = S^T (scale q)
        tl.store(out_row, out.to(out_ptr.dtype.element_ty), mask=cols < Dv)
        q_row, k_row = q_row + H * Dk, k_row + H * Dk
        v_row, out_row = v_row + H * Dv, out_row + H * Dv
        g_row, beta_row = g_row + H, beta_row + H
        slot = tl.load(slots_ptr + i)  # int64
        if slot >= 0:
            tl.store(states_ptr + (slot * H + head) * Dk * Dv + tile, state, mask=tile_ok)
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


# A tree up to this size gets a scratch row per node, sized without reading the tree back from
# the GPU (a sync per layer in every verify round); a longer pass (a prefill chunk) counts its
# branch points once.
ROWS_WITHOUT_COUNTING = 64


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
    T = q.shape[0]
    parents = parents.to(device=q.device, dtype=torch.int64).contiguous()
    if return_states:
        slots, rows = torch.arange(T, device=q.device), T
    else:
        marks = _branch_points(parents).to(torch.int64)
        slots = torch.where(marks > 0, marks.cumsum(0) - 1, -1)
        rows = T if T <= ROWS_WITHOUT_COUNTING else int(marks.sum())
    out, states = _run(q, k, v, g, beta, parents, slots, rows, initial_state, scale)
    return out, (states if return_states else None)


def chain_gated_delta_rule(
    q: torch.Tensor,  # [T, H, Dk]
    k: torch.Tensor,  # [T, H, Dk]
    v: torch.Tensor,  # [T, H, Dv]
    g: torch.Tensor,  # [T, H]
    beta: torch.Tensor,  # [T, H]
    initial_state: torch.Tensor,  # [H, Dk, Dv]
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # o [T, H, Dv], final state [H, Dk, Dv]
    """Triton version of `reference.chain_gated_delta_rule`: one scratch row, the last state."""
    T = q.shape[0]
    if T == 0:
        return v.new_empty(v.shape), initial_state.to(compute_dtype(v.dtype)).clone()
    parents = torch.arange(-1, T - 1, device=q.device)
    slots = torch.full((T,), -1, dtype=torch.int64, device=q.device)
    slots[-1] = 0
    out, states = _run(q, k, v, g, beta, parents, slots, 1, initial_state, scale)
    return out, states[0]


def _run(q, k, v, g, beta, parents, slots, rows: int, initial_state, scale: float):
    """Launch the kernel with a scratch of `rows` states; returns (o, scratch)."""
    T, H, Dk = q.shape
    Dv = v.shape[-1]
    compute = compute_dtype(v.dtype)
    scaled_q = (q.to(compute) * scale).contiguous()  # [T, H, Dk], exactly as the reference
    k, v, g, beta = (x.contiguous() for x in (k, v, g, beta))
    initial_state = initial_state.contiguous()
    states = torch.empty(rows, H, Dk, Dv, dtype=compute, device=q.device)
    out = torch.empty(T, H, Dv, dtype=v.dtype, device=q.device)
    if T == 0:
        return out, states
    block_k = triton.next_power_of_2(Dk)
    # A state tile of at most 4096 values: 32 registers a thread at 4 warps (fp32), and for
    # Qwen3.6 (48 heads, 128 x 128) 48 x 4 programs, more than an H200 has SMs.
    block_v = min(triton.next_power_of_2(Dv), max(16, 4096 // block_k))
    grid = (H, triton.cdiv(Dv, block_v))
    _tree_gated_delta_kernel[grid](
        scaled_q, k, v, g, beta, parents, slots, initial_state, states, out,
        T, H, Dk, Dv,
        COMPUTE=tl_compute_dtype(v.dtype),
        BLOCK_K=block_k, BLOCK_V=block_v,
    )  # fmt: skip
    return out, states
