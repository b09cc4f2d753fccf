"""Plain-torch references for the tree kernels: these functions ARE the specification.

Each Triton kernel in engine/kernels/ must match the function of the same name here (tests
compare them). The tree kernels' shapes carry no batch dimension (one sequence a call). The
fused layer pieces at the end (RMSNorm, RoPE, SiLU-multiply) take any leading dimensions, as the
model layers do.

A "tree" of T pending tokens is given by `parents` [T] (int64): parents[i] < i is the index
of token i's parent among the T tokens, or -1 when its parent is the last committed token.
A chain (prefill, DFlash chain) is parents = [-1, 0, 1, ..., T-2].

`paged_tree_attention` is the exception: several sequences at once, each reading its keys from
a pool of fixed-size KV blocks through its block table (engine/kv_blocks.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The precision the references compute in: float32, or float64 for float64 inputs (for a
    float dtype, `torch.promote_types(dtype, torch.float32)` without a dispatcher call: ~30 of
    them a round on the CPU, from the norms)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x.to(dtype)`, without the dispatcher call when x has that dtype already (x itself either
    way): the norms and RoPE tables ask it ~60 times a round on the CPU, mostly for nothing."""
    return x if x.dtype == dtype else x.to(dtype)


def key_visibility(
    T: int,
    S: int,
    prefix_len: int | torch.Tensor,  # an int, or an int64 tensor of one element
    tree_visible: torch.Tensor | None,  # [T, T] bool, None = causal
    device: torch.device,
) -> torch.Tensor:  # [T, S] bool
    """Which of S keys each of T pending tokens sees: every committed key (j < prefix_len), the
    tree keys tree_visible allows, and none from prefix_len + T on (a cache's unused end).

    Built without reading prefix_len back, so a device tensor costs no host sync.
    """
    if T == 0:
        return torch.zeros(0, S, dtype=torch.bool, device=device)
    if tree_visible is None:
        tree_visible = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    column = torch.arange(S, device=device) - prefix_len  # [S] tree column; < 0 in the prefix
    in_tree = (column >= 0) & (column < T)
    sees = tree_visible.to(device)[:, column.clamp(0, T - 1)]  # [T, S]
    return (column < 0) | (in_tree & sees)


def tree_attention(
    q: torch.Tensor,  # [T, Hq, D]  queries of the T pending tokens (RoPE applied)
    k: torch.Tensor,  # [S, Hkv, D] keys: the committed prefix, the T tokens, then any unused slots
    v: torch.Tensor,  # [S, Hkv, D]
    prefix_len: int | torch.Tensor,  # committed keys; an int or a one-element int64 tensor
    tree_visible: torch.Tensor | None,  # [T, T] bool: j is i's ancestor or i itself; None = causal
    scale: float,
) -> torch.Tensor:  # [T, Hq, D]
    """Each pending token attends to the whole committed prefix and to its own ancestors.

    Keys from prefix_len + T on are ignored, so k and v may be a whole preallocated cache.
    Grouped-query attention: query head h reads key/value head h // (Hq // Hkv).
    Computed in `compute_dtype` (float32, float64 for float64 inputs); the output has q's dtype.
    """
    T, Hq, D = q.shape
    S, Hkv, _ = k.shape
    visible = key_visibility(T, S, prefix_len, tree_visible, q.device)
    group = Hq // Hkv
    dt = compute_dtype(q.dtype)
    kf = k.to(dt).repeat_interleave(group, dim=1)  # [S, Hq, D]
    vf = v.to(dt).repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,shd->hts", q.to(dt), kf) * scale  # [Hq, T, S]
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hts,shd->thd", probs, vf).to(q.dtype)


def sequence_slots(
    block_table: torch.Tensor,  # [max_blocks] int64: the pool block holding each block of a sequence
    slots: torch.Tensor,  # [...] int64 slots of the sequence
    block_tokens: int,
) -> torch.Tensor:  # [...] int64 slots of the pool, flattened to [blocks * block_tokens]
    """Where a sequence's slots live in a KV block pool (engine/kv_blocks.py)."""
    return block_table[slots // block_tokens] * block_tokens + slots % block_tokens


def paged_sequences(
    q: torch.Tensor,  # [N, Hq, D]
    k_blocks: torch.Tensor,  # [blocks, block_tokens, Hkv, D]
    v_blocks: torch.Tensor,  # [blocks, block_tokens, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int64
    query_starts: torch.Tensor,  # [B + 1] int64
    prefix_lens: torch.Tensor,  # [B] int64
    tree_visible: torch.Tensor | None,  # [N, Tmax] bool; None = causal
):
    """Each sequence of a `paged_tree_attention` call as (rows, q, k, v, prefix_len, visible)
    for `tree_attention`: its queries, its first prefix_len + T slots gathered from the pool."""
    block_tokens = k_blocks.shape[1]
    keys, values = k_blocks.flatten(0, 1), v_blocks.flatten(0, 1)
    starts, prefixes = query_starts.tolist(), prefix_lens.tolist()
    for b, prefix in enumerate(prefixes):
        rows = slice(starts[b], starts[b + 1])
        T = rows.stop - rows.start
        positions = torch.arange(prefix + T, device=block_tables.device)
        slots = sequence_slots(block_tables[b], positions, block_tokens).to(k_blocks.device)
        visible = None if tree_visible is None else tree_visible[rows, :T]
        yield rows, q[rows], keys[slots], values[slots], prefix, visible


def paged_tree_attention(
    q: torch.Tensor,  # [N, Hq, D] the pending tokens of B sequences, concatenated
    k_blocks: torch.Tensor,  # [blocks, block_tokens, Hkv, D] one layer of a KV block pool
    v_blocks: torch.Tensor,  # [blocks, block_tokens, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int64: sequence b's slot s is in block
    #   block_tables[b, s // block_tokens] at offset s % block_tokens
    query_starts: torch.Tensor,  # [B + 1] int64: sequence b's queries are rows
    #   query_starts[b] .. query_starts[b + 1] - 1 of q (its T_b pending tokens)
    prefix_lens: torch.Tensor,  # [B] int64: committed slots of each sequence
    tree_visible: torch.Tensor | None,  # [N, Tmax] bool: row r of sequence b sees its pending
    #   token j when tree_visible[r, j] (each sequence's own [T_b, T_b] mask); None = causal
    scale: float,
) -> torch.Tensor:  # [N, Hq, D]
    """`tree_attention` of several sequences at once, each over its own blocks read in place:
    sequence b's pending K/V are already stored at its slots prefix_lens[b] .. + T_b - 1."""
    args = (q, k_blocks, v_blocks, block_tables, query_starts, prefix_lens, tree_visible)
    return attend_each_sequence(tree_attention, *args, scale=scale)


def attend_each_sequence(attend, q: torch.Tensor, *paged, scale: float) -> torch.Tensor:
    """`paged_tree_attention` by `attend` (a `tree_attention`) on each sequence in turn."""
    out = torch.empty_like(q)
    for rows, *args in paged_sequences(q, *paged):
        out[rows] = attend(*args, scale)
    return out


def tree_gated_delta_rule(
    q: torch.Tensor,  # [T, H, Dk]  (already L2-normalised; `scale` is applied here)
    k: torch.Tensor,  # [T, H, Dk]  (already L2-normalised)
    v: torch.Tensor,  # [T, H, Dv]
    g: torch.Tensor,  # [T, H]      log of the per-step decay (<= 0)
    beta: torch.Tensor,  # [T, H]   write strength in (0, 1)
    parents: torch.Tensor,  # [T] int64
    initial_state: torch.Tensor,  # [H, Dk, Dv] state after the last committed token
    scale: float,
    return_states: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated delta rule where each token's state starts from its parent's state.

    For token i with previous state S (its parent's, or `initial_state` for a root):
        S = S * exp(g_i)
        S = S + k_i (beta_i * (v_i - S^T k_i))^T
        o_i = S^T (scale * q_i)
    Computed in `compute_dtype` (float32, float64 for float64 inputs). Returns (o [T, H, Dv] in
    v's dtype, states [T, H, Dk, Dv] in the compute dtype when return_states, the state after
    each token: state i is what committing the path ending at i leaves behind).
    """
    T, H, Dk = q.shape
    Dv = v.shape[-1]
    dt = compute_dtype(v.dtype)
    qf, kf, vf = q.to(dt) * scale, k.to(dt), v.to(dt)
    decay, bf = g.to(dt).exp(), beta.to(dt)
    states = torch.empty(T, H, Dk, Dv, dtype=dt, device=q.device)
    out = torch.empty(T, H, Dv, dtype=dt, device=q.device)
    init = initial_state.to(dt)
    for i in range(T):
        p = int(parents[i])
        s = (init if p < 0 else states[p]) * decay[i][:, None, None]
        recalled = torch.einsum("hkv,hk->hv", s, kf[i])
        delta = (vf[i] - recalled) * bf[i][:, None]
        s = s + kf[i][:, :, None] * delta[:, None, :]
        states[i] = s
        out[i] = torch.einsum("hkv,hk->hv", s, qf[i])
    return out.to(v.dtype), (states if return_states else None)


def chain_gated_delta_rule(
    q: torch.Tensor,  # [T, H, Dk]  (already L2-normalised; `scale` is applied here)
    k: torch.Tensor,  # [T, H, Dk]
    v: torch.Tensor,  # [T, H, Dv]
    g: torch.Tensor,  # [T, H]
    beta: torch.Tensor,  # [T, H]
    initial_state: torch.Tensor,  # [H, Dk, Dv]
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # o [T, H, Dv] in v's dtype, final state [H, Dk, Dv]
    """`tree_gated_delta_rule` on a chain (a prefill chunk), keeping only the state after the
    last token: the recurrence carried from one chunk to the next without a state per token."""
    dt = compute_dtype(v.dtype)
    qf, kf, vf = q.to(dt) * scale, k.to(dt), v.to(dt)
    decay, bf = g.to(dt).exp(), beta.to(dt)
    out = torch.empty(q.shape[0], *v.shape[1:], dtype=dt, device=q.device)
    s = initial_state.to(dt)
    for i in range(q.shape[0]):
        s = s * decay[i][:, None, None]
        delta = (vf[i] - torch.einsum("hkv,hk->hv", s, kf[i])) * bf[i][:, None]
        s = s + kf[i][:, :, None] * delta[:, None, :]
        out[i] = torch.einsum("hkv,hk->hv", s, qf[i])
    return out.to(v.dtype), s


def tree_causal_conv1d(
    x: torch.Tensor,  # [T, C] inputs of the T pending tokens
    parents: torch.Tensor,  # [T] int64
    conv_state: torch.Tensor,  # [C, W] the W >= K-1 most recent committed inputs, oldest first
    weight: torch.Tensor,  # [C, K] depthwise kernel
    bias: torch.Tensor | None,  # [C]
    activation: str | None = "silu",
) -> torch.Tensor:  # [T, C]
    """Depthwise causal conv where token i's window is the last K inputs along its path.

    The path of i is: the committed inputs (conv_state), then i's ancestors root-first, then i.
    Computed in `compute_dtype`; the output has x's dtype.
    """
    T, C = x.shape
    W = conv_state.shape[1]
    K = weight.shape[-1]
    assert W >= K - 1, (W, K)
    dt = compute_dtype(x.dtype)
    # One sequence of W + T columns: the committed inputs, then the pending tokens. `previous`
    # gives each column's predecessor on its path (a root's is the newest committed input).
    columns = torch.cat([conv_state.to(dt), x.to(dt).T], dim=1)  # [C, W + T]
    previous = torch.cat(
        [
            torch.arange(-1, W - 1, device=x.device),
            torch.where(parents >= 0, parents + W, W - 1).to(x.device),
        ]
    )  # [W + T]
    window = [torch.arange(W, W + T, device=x.device)]  # column of each tap, newest first
    for _ in range(K - 1):
        window.append(previous[window[-1]])
    taps = torch.stack(window[::-1], dim=1)  # [T, K] oldest first
    out = (columns[:, taps] * weight.to(dt)[:, None, :]).sum(dim=-1).T  # [T, C]
    if bias is not None:
        out = out + bias.to(dt)
    if activation == "silu":
        out = F.silu(out)
    return out.to(x.dtype)


# --- fused layer pieces: RMSNorm (+ residual add), RoPE, SiLU-multiply ------------------------
# Each is the plain torch the model layers run, op for op (so the CPU's results stay those of
# transformers); the Triton versions (engine/kernels/triton_fused.py) do the same in one launch,
# rounding where these round.


def rms_norm(
    x: torch.Tensor,  # [..., N]
    weight: torch.Tensor,  # [N]
    eps: float,
    zero_centered: bool = False,
) -> torch.Tensor:  # [..., N]
    """x / rms(x), normalised in `compute_dtype`, then scaled.

    zero_centered=False (Qwen3's RMSNorm): weight * (normalised, rounded to x's dtype).
    zero_centered=True (Qwen3.5's): (normalised * (1 + weight)) in the compute dtype, rounded once.
    """
    dt = compute_dtype(x.dtype)
    xf = cast(x, dt)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if zero_centered:
        return cast(xf * (1.0 + cast(weight, dt)), x.dtype)
    return weight * cast(xf, x.dtype)


def add_rms_norm(
    x: torch.Tensor,  # [..., N] the residual stream
    delta: torch.Tensor,  # [..., N] what a sublayer adds to it
    weight: torch.Tensor,  # [N]
    eps: float,
    zero_centered: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:  # rms_norm(x + delta), x + delta (in x's dtype)
    """The residual add before a pre-norm sublayer, and that sublayer's norm of the sum."""
    summed = x + delta
    return rms_norm(summed, weight, eps, zero_centered), summed


def apply_rotary(
    x: torch.Tensor,  # [..., T, heads, D]
    cos: torch.Tensor,  # [..., T, R] (R <= D, even)
    sin: torch.Tensor,  # [..., T, R]
) -> torch.Tensor:  # [..., T, heads, D]
    """RoPE in HF's "rotate_half" layout on the first R dims of each head; the rest pass through."""
    R = cos.shape[-1]
    rot = x if R == x.shape[-1] else x[..., :R]
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # [..., T, 1, R]
    half = R // 2
    rotated_half = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    rotated = rot * cos + rotated_half * sin
    return rotated if rot is x else torch.cat([rotated, x[..., R:]], dim=-1)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:  # [..., I]
    """SwiGLU's activation: silu(gate) * up."""
    return F.silu(gate) * up
