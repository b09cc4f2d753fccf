"""Plain-torch tree kernels for CPU that handle all nodes at once, with no per-token loop.

On CPU the engine's cost is in the number of small torch calls, not in flops. The reference
gated delta rule (engine/kernels/reference.py, the specification) runs ~8 calls per token;
this one solves a whole tree in a fixed number of calls, whatever its size.

The closed form, per value head, for nodes ordered so that parents come first. Let A[i, j]
mean "j is i or an ancestor of i", G_i the sum of g along i's path (root first, i included),
W[i, j] = A[i, j] exp(G_i - G_j) and u_j = beta_j (v_j - S_j'^T k_j), the write of node j
(S_j' its parent's state after j's decay). Unrolling S along a path gives

    S_i = exp(G_i) S_0 + sum_j W[i, j] k_j u_j^T
    u_i + beta_i sum_{j strict ancestor} W[i, j] (k_i . k_j) u_j = beta_i (v_i - exp(G_i) S_0^T k_i)

a unit lower-triangular system in u (one solve), after which outputs o_i = S_i^T q_i and any
node's state are matrix products. `solve_tree` keeps those factors (W, k, u, exp(G)), so the
engine can build the one state it commits instead of storing every node's (TreeStates). A long
chain (a prefill) is solved in CHAIN_PIECE-token pieces, each starting from the state the
previous one left, which bounds the [T, T] matrices.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from engine.kernels import reference
from engine.kernels.reference import cast, compute_dtype
from engine.memory_plan import CHAIN_PIECE
from engine.transfer import DeviceIndices

QUERY_BLOCK = 256  # prefill queries per attention call on the CPU (see tree_attention)


def is_chain(parents: torch.Tensor) -> bool:
    """True for parents = [-1, 0, 1, ..., T-2] (a prefill, a DFlash chain, a replay)."""
    return np.array_equal(parents.cpu().numpy(), np.arange(-1, parents.shape[0] - 1))


def ancestor_matrix(parents: torch.Tensor) -> torch.Tensor:
    """[T, T] bool: entry (i, j) is True when j is i or one of i's ancestors."""
    T = parents.shape[0]
    if is_chain(parents):  # everything before i
        return torch.ones(T, T, dtype=torch.bool, device=parents.device).tril()
    links = parents.cpu().numpy()
    visible = np.eye(T, dtype=bool)
    for i, parent in enumerate(links):
        if parent >= 0:
            visible[i] |= visible[parent]
    return torch.from_numpy(visible).to(parents.device)


@dataclass
class SolvedPiece:
    """The factors of one solved tree (or chain piece), heads first; see the module docstring:
    W [H, T, T], the keys [H, T, Dk], the writes u [H, T, Dv] and exp(G) [H, T] (how much of the
    initial state each node keeps). One of trees solved stacked reads its own from their
    stack when first asked (a batched pass's commit builds the states from the stack: most
    never are)."""

    factors: tuple[torch.Tensor, ...] | None  # (W, keys, writes, exp(G)); None: from `stacked`
    initial: torch.Tensor | None  # [H, Dk, Dv] the state before the piece (None: a stack's,
    # once unstacked: its trees hold theirs)
    stacked: tuple[SolvedPiece, int] | None = None  # one of trees solved stacked: their
    # piece (leading dimension) and this one's index

    @property
    def weights(self) -> torch.Tensor:  # [H, T, T]
        return self._factors()[0]

    @property
    def keys(self) -> torch.Tensor:  # [H, T, Dk]
        return self._factors()[1]

    @property
    def writes(self) -> torch.Tensor:  # [H, T, Dv]
        return self._factors()[2]

    @property
    def start_decay(self) -> torch.Tensor:  # [H, T]
        return self._factors()[3]

    def _factors(self) -> tuple[torch.Tensor, ...]:
        if self.factors is None:
            stack, index = self.stacked
            self.factors = tuple(t[index] for t in stack._factors())
        return self.factors

    def state_after(self, node: int) -> torch.Tensor:  # [H, Dk, Dv]
        return self.write_state_after(node, torch.empty_like(self.initial))

    def write_state_after(self, node: int, out: torch.Tensor) -> torch.Tensor:
        """The state after `node` written into `out` [H, Dk, Dv] (which may be `initial`
        itself: a commit's): the decayed initial state, then the writes added by one baddbmm,
        with no state-sized temporaries (at Qwen3.6-27B's widths about half the time of a
        product and a sum on the CPU, and there the same values)."""
        weighted_keys = self.keys * self.weights[:, node, :, None]  # [H, T, Dk]
        torch.mul(self.initial, self.start_decay[:, node, None, None], out=out)
        return out.baddbmm_(weighted_keys.transpose(1, 2), self.writes)

    def all_states(self) -> torch.Tensor:  # [T, H, Dk, Dv]
        H, T, Dk = self.keys.shape
        outer = (self.keys[:, :, :, None] * self.writes[:, :, None, :]).reshape(H, T, -1)
        states = (self.weights @ outer).reshape(H, T, Dk, -1)
        states = states + self.start_decay[:, :, None, None] * self.initial[:, None]
        return states.transpose(0, 1)

    def unstack(self, initials: list[torch.Tensor]) -> list[SolvedPiece]:
        """The pieces of trees solved stacked (leading dimension), each keeping its own
        `initials` entry (its state before the pass, not a stacked copy of it). The stack lets
        go of the copy its solve read: held to the commit, it was a state a tree a layer (at
        Qwen3.6-27B 146.8 MiB a sequence a batched pass, past what the memory plan counts)."""
        self.initial = None
        return [SolvedPiece(None, initial, (self, i)) for i, initial in enumerate(initials)]

    def write_states_after(
        self,
        members: list[int],
        nodes: list[int],
        initial: torch.Tensor,
        indices: DeviceIndices | None = None,
    ) -> torch.Tensor:
        """Of trees solved stacked (this the stack's piece): the state after `nodes[j]` of tree
        `members[j]`, [len(members), H, Dk, Dv], from `initial` [len(members), H, Dk, Dv] their
        states before the pass, in one set of calls whatever their number: `write_state_after`'s
        maths, its product batched (so equal within rounding: BLAS may sum a batch's products
        in another order). `indices`: the pass's, whose layers commit the same members and
        nodes (copied to the device once for all of them)."""
        indices = indices if indices is not None else DeviceIndices(self.weights.device)
        index, at = indices.of(tuple(members)), indices.of(tuple(nodes))
        every = members == list(range(self.weights.shape[0]))
        return self.states_after_at(index, at, initial, every)

    def states_after_at(
        self, index: torch.Tensor, at: torch.Tensor, initial: torch.Tensor, every: bool = False
    ) -> torch.Tensor:
        """`write_states_after` with the trees and their nodes on the device (`index`, `at`
        [n]; `every`: `index` is every tree in order): a static commit's (engine/tree_passes.py),
        the same calls whatever they are; `initial` [n, H, Dk, Dv] their states before."""
        keys, writes = (
            (t if every else t.index_select(0, index)) for t in (self.keys, self.writes)
        )
        weighted_keys = keys * self.weights[index, :, at, :, None]  # [n, H, T, Dk]
        out = initial * self.start_decay[index, :, at, None, None]
        n, H, Dk, Dv = out.shape
        batched = out.view(n * H, Dk, Dv)
        batched.baddbmm_(weighted_keys.transpose(2, 3).flatten(0, 1), writes.flatten(0, 1))
        return out

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._factors())


@dataclass
class TreeStates:
    """The state after any node of a solved tree, built on demand (no per-node copies kept)."""

    pieces: list[SolvedPiece]
    piece_len: int

    def state_after(self, node: int) -> torch.Tensor:  # [H, Dk, Dv]
        return self.pieces[node // self.piece_len].state_after(node % self.piece_len)

    def write_state_after(self, node: int, out: torch.Tensor) -> torch.Tensor:
        """`state_after` written into `out` (see SolvedPiece.write_state_after)."""
        piece = self.pieces[node // self.piece_len]
        return piece.write_state_after(node % self.piece_len, out)

    def all_states(self) -> torch.Tensor:  # [T, H, Dk, Dv]
        return torch.cat([piece.all_states() for piece in self.pieces])

    def nbytes(self) -> int:
        """The factors, and the start states of the pieces after the first (the first one's is
        the committed state, not held here)."""
        starts = sum(p.initial.numel() * p.initial.element_size() for p in self.pieces[1:])
        return starts + sum(piece.nbytes() for piece in self.pieces)


def _solve_piece(
    q: torch.Tensor,  # [..., H, T, Dk] scaled
    k: torch.Tensor,  # [..., H, T, Dk]
    v: torch.Tensor,  # [..., H, T, Dv]
    g: torch.Tensor,  # [..., H, T]
    beta: torch.Tensor,  # [..., H, T]
    visible: torch.Tensor,  # [..., T, T] bool, see ancestor_matrix (one per leading index)
    state: torch.Tensor,  # [..., H, Dk, Dv]
) -> tuple[torch.Tensor, SolvedPiece]:  # outputs [..., H, T, Dv]
    """One tree, or several of one size stacked on leading dimensions (a batched pass's verify
    trees): each its own system, all solved in the same calls."""
    G = g @ visible.to(g.dtype).mT  # [..., H, T]: path sums of the log decay
    gaps = (G[..., :, None] - G[..., None, :]).masked_fill(~visible[..., None, :, :], float("-inf"))
    weights = gaps.exp()  # [..., H, T, T] W: lower triangular, zero off the paths
    # The solve reads only the strict lower triangle (unitriangular): the diagonal stays as is.
    system = beta[..., None] * weights * (k @ k.mT)
    start_decay = G.exp()
    rhs = beta[..., None] * (v - start_decay[..., None] * (k @ state))
    writes = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    out = start_decay[..., None] * (q @ state) + (weights * (q @ k.mT)) @ writes
    return out, SolvedPiece((weights, k, writes, start_decay), state)


def solve_tree(
    q: torch.Tensor,  # [T, H, Dk]
    k: torch.Tensor,  # [T, H, Dk]
    v: torch.Tensor,  # [T, H, Dv]
    g: torch.Tensor,  # [T, H]
    beta: torch.Tensor,  # [T, H]
    parents: torch.Tensor,  # [T] int64
    initial_state: torch.Tensor,  # [H, Dk, Dv]
    scale: float,
) -> tuple[torch.Tensor, TreeStates]:
    """(outputs [T, H, Dv] in v's dtype, the states of every node on demand); T >= 1.

    Same maths as `reference.tree_gated_delta_rule`, computed in `compute_dtype`.
    """
    T = q.shape[0]
    dt = compute_dtype(v.dtype)
    heads_first = [cast(t, dt).transpose(0, 1) for t in (q * scale, k, v, g, beta)]
    chain = is_chain(parents)
    piece_len = CHAIN_PIECE if chain else T  # a tree is solved whole
    # A chain's pieces are all lower triangles: never build its [T, T] matrix.
    visible = ancestor_matrix(parents if not chain else parents[:piece_len])
    state, outs, pieces = cast(initial_state, dt), [], []
    for start in range(0, T, piece_len):
        end = min(T, start + piece_len)
        qp, kp, vp, gp, bp = (t[:, start:end] for t in heads_first)
        piece_visible = visible[: end - start, : end - start] if chain else visible
        out, piece = _solve_piece(qp, kp, vp, gp, bp, piece_visible, state)
        outs.append(out)
        pieces.append(piece)
        if end < T:
            state = piece.state_after(end - start - 1)
    return cast(torch.cat(outs, dim=1).transpose(0, 1), v.dtype), TreeStates(pieces, piece_len)


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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Same contract and results as `reference.tree_gated_delta_rule`, in a fixed number of calls."""
    if q.shape[0] == 0:
        states = initial_state.new_empty(0, *initial_state.shape, dtype=compute_dtype(v.dtype))
        return v.new_empty(v.shape), (states if return_states else None)
    out, states = solve_tree(q, k, v, g, beta, parents, initial_state, scale)
    return out, (states.all_states() if return_states else None)


def chain_gated_delta_rule(
    q: torch.Tensor,  # [T, H, Dk]
    k: torch.Tensor,  # [T, H, Dk]
    v: torch.Tensor,  # [T, H, Dv]
    g: torch.Tensor,  # [T, H]
    beta: torch.Tensor,  # [T, H]
    initial_state: torch.Tensor,  # [H, Dk, Dv]
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract and results as `reference.chain_gated_delta_rule`, solved in pieces."""
    if q.shape[0] == 0:
        return v.new_empty(v.shape), initial_state.to(compute_dtype(v.dtype)).clone()
    chain = torch.arange(-1, q.shape[0] - 1)
    out, states = solve_tree(q, k, v, g, beta, chain, initial_state, scale)
    return out, states.state_after(q.shape[0] - 1)


def tree_causal_conv1d(
    x: torch.Tensor,  # [T, C]
    parents: torch.Tensor,  # [T] int64
    conv_state: torch.Tensor,  # [C, W]
    weight: torch.Tensor,  # [C, K]
    bias: torch.Tensor | None,  # [C]
    activation: str | None = "silu",
) -> torch.Tensor:  # [T, C]
    """Same contract as `reference.tree_causal_conv1d`; a chain (a prefill chunk) runs as one
    depthwise conv1d instead of gathering a [C, T, K] window per token."""
    if not is_chain(parents):
        return reference.tree_causal_conv1d(x, parents, conv_state, weight, bias, activation)
    K = weight.shape[-1]
    dt = compute_dtype(x.dtype)
    columns = torch.cat([conv_state[:, conv_state.shape[1] - (K - 1) :].to(dt), x.to(dt).T], 1)
    out = F.conv1d(columns[None], weight.to(dt)[:, None, :], groups=x.shape[1])[0].T  # [T, C]
    if bias is not None:
        out = out + bias.to(dt)
    if activation == "silu":
        out = F.silu(out)
    return out.to(x.dtype)


def key_mask(
    T: int,
    S: int,
    prefix_len: int | torch.Tensor,
    tree_visible: torch.Tensor,  # [T, T] bool
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:  # [T, S] in dtype
    """`reference.key_visibility` as the mask scaled_dot_product_attention adds to the scores
    (0 where a key is seen, -inf elsewhere): what torch makes of a boolean mask at every call,
    made once for all the layers of a pass (the results are the same, bit for bit)."""
    seen = reference.key_visibility(T, S, prefix_len, tree_visible, device)
    return torch.zeros(T, S, dtype=dtype, device=device).masked_fill_(~seen, float("-inf"))


def tree_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [S, Hkv, D], S >= prefix_len + T
    v: torch.Tensor,  # [S, Hkv, D]
    prefix_len: int | torch.Tensor,  # a tensor only with a tree (a verify round)
    tree_visible: torch.Tensor | None,  # [T, T] bool, None = causal
    scale: float,
    mask: torch.Tensor | None = None,  # [T, S] `key_mask` of the above, when the caller has it
) -> torch.Tensor:  # [T, Hq, D]
    """Same contract as `reference.tree_attention`, streaming over the keys.

    torch's scaled_dot_product_attention (its flash kernel on the CPU, under a boolean mask)
    keeps a running softmax over key blocks: no [Hq, T, S] score tensor, whose size grows with
    the square of a prefill. torch turns the mask into a float one, [rows, S] in the compute
    dtype, so a prefill chunk's queries go QUERY_BLOCK at a time (each over the keys it can see):
    1.25 KiB of mask per key instead of 5 per query row. torch's lower-right causal bias would
    need no mask but imports triton, which a CPU process should not pay ~150 MB for.
    """
    if tree_visible is not None:  # a verify round: few rows
        if mask is None:
            mask = key_mask(q.shape[0], k.shape[0], prefix_len, tree_visible, q.dtype, q.device)
        return _attend(q, k, v, mask, scale)
    out = torch.empty_like(q)
    for start in range(0, q.shape[0], QUERY_BLOCK):
        end = min(q.shape[0], start + QUERY_BLOCK)
        keys = prefix_len + end  # the last query of the block sees up to itself
        mask = torch.ones(end - start, keys, dtype=torch.bool, device=q.device)
        out[start:end] = _attend(
            q[start:end], k[:keys], v[:keys], mask.tril(prefix_len + start), scale
        )
    return out


def paged_tree_attention(
    q: torch.Tensor,  # [N, Hq, D]
    k_blocks: torch.Tensor,  # [blocks, block_tokens, Hkv, D]
    v_blocks: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int64
    query_starts: torch.Tensor,  # [B + 1] int64
    prefix_lens: torch.Tensor,  # [B] int64
    tree_visible: torch.Tensor | None,  # [N, Tmax] bool; None = causal
    scale: float,
) -> torch.Tensor:  # [N, Hq, D]
    """Same contract as `reference.paged_tree_attention`: each sequence's keys gathered from
    its blocks, then `tree_attention` above."""
    args = (q, k_blocks, v_blocks, block_tables, query_starts, prefix_lens, tree_visible)
    return reference.attend_each_sequence(tree_attention, *args, scale=scale)


def _attend(q, k, v, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """q [T, Hq, D] over k, v [S, Hkv, D] under mask [T, S]: [T, Hq, D]."""
    # [1, heads, tokens, D] views: without the batch dimension torch falls back to its math
    # kernel, which materialises the scores.
    q, k, v = (x[None].transpose(1, 2) for x in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


__all__ = [
    "chain_gated_delta_rule",
    "key_mask",
    "paged_tree_attention",
    "solve_tree",
    "tree_attention",
    "tree_causal_conv1d",
    "tree_gated_delta_rule",
]
