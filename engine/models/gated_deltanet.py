"""Gated DeltaNet, the linear-attention mixer of the hybrid Qwen3.5/3.6 targets, with tree-aware state.

A GDN layer carries two pieces of state across tokens: the causal conv1d window (the last K-1
inputs of its depthwise conv, `conv` [C, K-1]) and the delta-rule matrix (`recurrent`
[Hv, Dk, Dv], kept in float32, float64 for float64 models). In a verify pass over a tree of
pending tokens each node's conv window is gathered along its ancestors and its recurrent state
starts from its parent's (engine.kernels tree_causal_conv1d / tree_gated_delta_rule). Nothing
is written to the committed state during the pass; `commit` then installs exactly the state of
the last accepted node. Three strategies, selectable per model, and "auto":

- "replay": the pass keeps each node's delta-rule inputs (its conv output and g,
  beta); commit re-runs the recurrence along the accepted path only. Extra memory per node
  is O(conv_dim), a few tens of KiB per layer at 27B shapes.
- "snapshot": the pass keeps every node's recurrent state; commit picks one. Extra memory per
  node is Hv*Dk*Dv floats per layer (3 MiB per layer at 27B shapes), so a long prefill under
  this strategy holds T such states: use it for small models or short chains only.
- "factored": the pass solves the whole tree at once (engine/kernels/batched.py) and keeps
  the solve's factors (per node: its key, its write and its row of path decays); commit builds
  the one state it installs from them. Extra memory per node is O(Hv * (Dk + Dv + T)), and
  commit costs a couple of matrix products. Plain torch, so any device, but it is what CPUs want:
  a tree in a fixed number of torch calls instead of a loop over tokens.
- "auto": with the batched torch kernels (CPU) factored while its factors fit in
  SNAPSHOT_LIMIT_BYTES per layer (verify rounds, short prefills); otherwise (Triton on CUDA, a
  long prefill) snapshot when the pass's states fit there, else replay (`choose_strategy`).
  A batched pass's trees are factored on every device while they fit (`factored_fits`): all
  its sequences' trees in one set of calls a layer (`factored_mix`), where Triton would run a
  kernel (and its conv, heads and commit) per sequence per layer.

The static-shape verify (`forward_static`, for CUDA graphs) returns what it keeps instead:
"factored" with the CPU's batched kernels, else "snapshot" (commit by selection: the pass's
per-node states, which the Triton kernel writes anyway, and commit copies the accepted one) when
`choose_keep` finds a round's states fit in free device memory, else "replay".

A scheduler's sequences keep their committed states as slots of one `StateSlots` a layer
(`Qwen3_5Model.share_states`): a batched pass's one-token steps read theirs with one gather
and, their path being [0] whatever is chosen, write them back with one scatter as they run
(`single_steps`; a static step's at device indices, `steps_at`: engine/step_passes.py, a CUDA
graph a bucket), so the pass holds one layer's copies at a time; `commit_many` installs what a
pass's trees leave (their conv windows, their stacked states built from the committed ones)
with one scatter a layer instead of a copy a sequence. A static tree step (engine/tree_passes.py,
a CUDA graph a bucket) solves its trees stacked at their slots' device indices (`trees_at`) and
its commit, a second graph, builds and writes their states the same way (`commit_trees_at`).

`pending_bytes` gives the extra memory per round of each strategy for any config; for
Qwen3.6-27B (48 GDN layers, bf16, 16-token verify; `python -m engine.models.gated_deltanet`):
replay 30.2 MiB, factored 53.4 MiB, snapshot 2319 MiB, and snapshot's per-node states are also
written every round (~2.3 GiB of memory traffic). What the batched solve gains on the CPU is in
engine/NOTES.md.
Parameter names and the maths follow transformers' Qwen3_5GatedDeltaNet, so HF checkpoints load
as they are.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import (
    backend_for,
    chain_gated_delta_rule,
    tree_causal_conv1d,
    tree_gated_delta_rule,
)
from engine.kernels.batched import SolvedPiece, TreeStates, solve_tree
from engine.kernels.batched import _solve_piece as solve_piece
from engine.kernels.reference import cast, compute_dtype
from engine.memory_plan import factored_elements
from engine.transfer import DeviceIndices, to_device
from engine.tree import TreeInputs

StateStrategy = Literal["auto", "replay", "snapshot", "factored"]
STATE_STRATEGIES: tuple[str, ...] = ("auto", "replay", "snapshot", "factored")
# "auto" snapshots a pass whose per-node states stay under this, per layer (a tiny model's
# verify round), and replays anything bigger (a 27B round: 48 MiB per layer; a long prefill).
SNAPSHOT_LIMIT_BYTES = 16 << 20
REPLAY_PIECE = 64  # tokens re-run per kernel call when replaying an accepted path
STATIC_VERIFY_TOKENS = 16  # the verify width `choose_keep` sizes the snapshot buffer for
SNAPSHOT_HEADROOM = 0.5  # the snapshot buffer may take at most this share of free memory


@dataclass
class GDNShape:
    """The sizes of one GDN layer, read from the model config."""

    hidden_size: int
    key_heads: int  # Hk
    value_heads: int  # Hv (a multiple of Hk: each key head serves Hv // Hk value heads)
    key_dim: int  # Dk
    value_dim: int  # Dv
    conv_kernel: int  # K
    eps: float

    @property
    def conv_dim(self) -> int:  # C: q, k and v go through the conv together
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim


@dataclass
class RecurrentState:
    """The committed state of one GDN layer: slot `index` of `slots` (a sequence's own)."""

    conv: torch.Tensor  # [C, K-1] the last K-1 conv inputs, oldest first (model dtype)
    recurrent: torch.Tensor  # [Hv, Dk, Dv] (float32, float64 for float64 models)
    slots: StateSlots
    index: int


class StateSlots:
    """One GDN layer's committed states of `count` sequences as the rows of two tensors (a
    scheduler's slots, `Qwen3_5Model.share_states`): the states of a batched pass's one-token
    steps are read with one gather a layer and committed with one scatter, where each was a
    copy of its own (on CUDA, launches a layer and row)."""

    def __init__(
        self,
        count: int,
        shape: GDNShape,
        dtype: torch.dtype,
        device: torch.device | str,
        indices: DeviceIndices | None = None,
    ) -> None:
        s = shape
        # the slots' indices on the device, shared with the other layers' slots of the same
        # sequences (`Qwen3_5Model.share_states`): a pass's layers gather the same rows
        self.indices = indices if indices is not None else DeviceIndices(device)
        self.conv = torch.zeros(count, s.conv_dim, s.conv_kernel - 1, dtype=dtype, device=device)
        self.recurrent = torch.zeros(
            count, s.value_heads, s.key_dim, s.value_dim, dtype=compute_dtype(dtype), device=device
        )
        self.states = [
            RecurrentState(self.conv[i], self.recurrent[i], self, i) for i in range(count)
        ]


def shared_slots(states: list[RecurrentState]) -> StateSlots | None:
    """The `StateSlots` every one of `states` is a slot of, if they share one."""
    slots = states[0].slots
    return slots if all(state.slots is slots for state in states) else None


def _gathered(states: list[RecurrentState], *names: str) -> tuple[torch.Tensor, ...]:
    """Each named part of `states` stacked, a copy [n, ...]: one gather each when the states
    are slots of one `StateSlots`."""
    slots = shared_slots(states)
    if slots is None:
        return tuple(torch.stack([getattr(state, name) for state in states]) for name in names)
    index = slots.indices.of(tuple(state.index for state in states))
    return tuple(getattr(slots, name).index_select(0, index) for name in names)


def install(
    states: list[RecurrentState],
    conv: torch.Tensor | None = None,
    recurrent: torch.Tensor | None = None,
) -> None:
    """Row i of `conv` [n, C, K-1] and of `recurrent` [n, Hv, Dk, Dv] (those given) in place as
    states[i]'s: one scatter each when the states are slots of one `StateSlots`."""
    parts = [
        (name, rows)
        for name, rows in (("conv", conv), ("recurrent", recurrent))
        if rows is not None
    ]
    slots = shared_slots(states)
    if slots is not None:
        index = slots.indices.of(tuple(state.index for state in states))
        for name, rows in parts:
            getattr(slots, name).index_copy_(0, index, rows)
        return
    for name, rows in parts:
        for state, row in zip(states, rows, strict=True):
            getattr(state, name).copy_(row)


_STEP_PARENTS = torch.tensor([-1])  # a one-token step's tree: its token, a root


@dataclass(frozen=True)
class InstalledStep:
    """What a one-token step leaves for commit: nothing, its pass installed its state
    (`single_steps`, `steps_at`); its path can only be [0]."""

    parents: torch.Tensor = _STEP_PARENTS


INSTALLED = InstalledStep()


@dataclass
class TreeWindows:
    """The conv inputs a batched pass's trees read (`factored_mix`): every tree's committed
    inputs, then every tree's tokens (`TreesLayout`), and every node's window in them, from
    which commit takes each tree's conv state after its last accepted node (that node's
    window but its oldest input)."""

    rows: torch.Tensor  # [N, C] (model dtype)
    taps: torch.Tensor  # [sum T_i, K] each node's window, rows of `rows`, oldest first
    indices: DeviceIndices  # the pass's: every layer commits the same nodes

    def commit(self, nodes: list[int], states: list[RecurrentState]) -> None:
        """Install in states[i] the conv state after node nodes[i] (a row of `taps`), all at
        once."""
        nodes_at = self.indices.of(tuple(nodes))
        install(states, conv=windows_after(self.rows, self.taps, nodes_at))


@dataclass(frozen=True)
class StaticTrees:
    """The trees of a static tree step (engine/tree_passes.py): S trees of W nodes each, in
    device buffers its bucket's pass reads whoever's trees fill them."""

    visible: torch.Tensor  # [S, W, W] bool each node's ancestors and itself
    taps: torch.Tensor  # [S * W, K] each node's conv window (`trees_taps`)
    arena: Any = None  # step_passes.KeptArena each layer's kept tensors are held in


@dataclass
class PendingRecurrence:
    """What a verify pass leaves behind in one GDN layer for `commit` to choose from."""

    parents: torch.Tensor | np.ndarray | None  # [T], what commit checks a path against (a
    # batched pass's trees: on the host; None after forward_static: the tree is on the host)
    conv_inputs: torch.Tensor  # [T, C] the new conv state is built from the accepted ones
    conv_outputs: torch.Tensor | None = None  # [T, C]  replay: delta-rule inputs, with g and beta
    g: torch.Tensor | None = None  # [T, Hv]
    beta: torch.Tensor | None = None  # [T, Hv]
    node_states: torch.Tensor | None = None  # [T, Hv, Dk, Dv]  snapshot: the state after each node
    tree_states: TreeStates | None = None  # factored: any node's state on demand
    windows: tuple[TreeWindows, int] | None = None  # a batched pass's trees': (theirs, my first)

    def nbytes(self) -> int:
        tensors = (self.conv_inputs, self.conv_outputs, self.g, self.beta, self.node_states)
        factors = self.tree_states.nbytes() if self.tree_states is not None else 0
        return factors + sum(t.numel() * t.element_size() for t in tensors if t is not None)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (the FLA / transformers convention)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


class GatedRMSNorm(nn.Module):
    """weight * rmsnorm(x) * silu(gate), normalised in float32 (float64 for float64 inputs)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dt = compute_dtype(x.dtype)
        xf = cast(x, dt)
        normed = cast(xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps), x.dtype)
        return cast(self.weight * normed * F.silu(cast(gate, dt)), x.dtype)


class GatedDeltaNet(nn.Module):
    """One Gated DeltaNet mixer over the T pending tokens of a tree (batch 1, no batch dim)."""

    def __init__(self, shape: GDNShape) -> None:
        super().__init__()
        self.shape = shape
        s = shape
        qk_dim, v_dim = s.key_heads * s.key_dim, s.value_heads * s.value_dim
        self.in_proj_qkv = nn.Linear(s.hidden_size, 2 * qk_dim + v_dim, bias=False)
        self.in_proj_z = nn.Linear(s.hidden_size, v_dim, bias=False)
        self.in_proj_b = nn.Linear(s.hidden_size, s.value_heads, bias=False)
        self.in_proj_a = nn.Linear(s.hidden_size, s.value_heads, bias=False)
        # Only its weight [C, 1, K] is used (by the tree conv); a Conv1d keeps HF's key name.
        self.conv1d = nn.Conv1d(
            s.conv_dim, s.conv_dim, s.conv_kernel, groups=s.conv_dim, bias=False
        )
        self.dt_bias = nn.Parameter(torch.ones(s.value_heads))
        self.A_log = nn.Parameter(torch.zeros(s.value_heads))
        self.norm = GatedRMSNorm(s.value_dim, s.eps)
        self.out_proj = nn.Linear(v_dim, s.hidden_size, bias=False)

    def new_state(self, dtype: torch.dtype, device: torch.device | str) -> RecurrentState:
        return self.new_states(1, dtype, device)[0]

    def new_states(
        self,
        count: int,
        dtype: torch.dtype,
        device: torch.device | str,
        indices: DeviceIndices | None = None,
    ) -> list[RecurrentState]:
        """`count` zero states, the slots of one `StateSlots` (`indices`: shared with other
        layers' slots of the same sequences)."""
        return StateSlots(count, self.shape, dtype, device, indices).states

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden] (normed)
        state: RecurrentState,
        parents: torch.Tensor,  # [T]
        strategy: StateStrategy,
    ) -> tuple[torch.Tensor, PendingRecurrence]:
        """Mix the pending tokens; returns the output [T, hidden] and what commit needs."""
        inputs = self._inputs(x)
        out, pending = self.tree_mix(inputs, state, parents, strategy)
        return self._output(out, x), pending

    def tree_mix(
        self,
        inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],  # `_inputs`: conv inputs, beta, g
        state: RecurrentState,
        parents: torch.Tensor,  # [T]
        strategy: StateStrategy,
    ) -> tuple[torch.Tensor, PendingRecurrence]:
        """`forward` between the projections: the delta rule's output [T, Hv, Dv] over the
        tree from its projected inputs, and what commit needs (a batched pass projects every
        sequence's rows at once and mixes each against its own state)."""
        conv_inputs, beta, g = inputs
        T = conv_inputs.shape[0]
        s = self.shape
        if strategy == "auto":
            strategy = choose_strategy(s, T, state.recurrent.dtype, backend_for(state.recurrent))
        conv_outputs = tree_causal_conv1d(
            conv_inputs, parents, state.conv, self.conv1d.weight[:, 0], None, "silu"
        )  # [T, C]
        pending = PendingRecurrence(parents=parents, conv_inputs=conv_inputs)
        q, k, v = self._heads(conv_outputs)
        if strategy == "factored":
            out, pending.tree_states = solve_tree(
                q, k, v, g, beta, parents, state.recurrent, s.key_dim**-0.5
            )
        else:
            out, node_states = tree_gated_delta_rule(
                q, k, v, g, beta, parents, state.recurrent, s.key_dim**-0.5, strategy == "snapshot"
            )  # [T, Hv, Dv]
        if strategy == "snapshot":
            pending.node_states = node_states
        elif strategy == "replay":
            pending.conv_outputs, pending.g, pending.beta = conv_outputs, g, beta
        return out, pending

    def forward_static(
        self,
        x: torch.Tensor,  # [T, hidden] (normed)
        state: RecurrentState,
        inputs: TreeInputs,
        keep: str,  # "factored" | "snapshot" | "replay"
        taps: torch.Tensor | None,  # [T, K] conv_taps of the tree, with "factored"
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """`forward` over the device-side tree: the output [T, hidden] and the tensors `keep`
        needs for commit (see `pending_from`); no host reads, static shapes."""
        keep = keep_for(keep, x.shape[0])
        conv_inputs, beta, g = self._inputs(x)
        weight = self.conv1d.weight[:, 0]
        if keep == "factored":  # the batched conv would tell a chain from a tree on the host
            conv_outputs = conv_at_taps(window_rows(state.conv, conv_inputs), weight, taps)
        else:
            conv_outputs = tree_causal_conv1d(conv_inputs, inputs.parents, state.conv, weight, None)
        q, k, v = self._heads(conv_outputs)
        scale = self.shape.key_dim**-0.5
        if keep == "factored":
            out, piece = solve_visible(q, k, v, g, beta, inputs.visible, state.recurrent, scale)
            kept = (conv_inputs, piece.weights, piece.keys, piece.writes, piece.start_decay)
        else:
            out, states = tree_gated_delta_rule(
                q, k, v, g, beta, inputs.parents, state.recurrent, scale, keep == "snapshot"
            )
            kept = (
                (conv_inputs, states)
                if keep == "snapshot"
                else (conv_inputs, conv_outputs, g, beta)
            )
        return self._output(out, x), kept

    def factored_mix(
        self,
        inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],  # `_inputs` of the trees' rows
        states: list[RecurrentState],  # each tree's own
        layout: TreesLayout,  # the pass's trees, made once for all its GDN layers
    ) -> tuple[torch.Tensor, list[PendingRecurrence]]:
        """`tree_mix` under "factored" of several segments at once (a batched pass's verify
        trees): one conv over every tree's window (the committed inputs of all, gathered at
        once, then their tokens), the heads of all rows at once, then the trees solved
        against their own states, those of one size together (`solve_trees`). Returns the
        outputs [sum T_i, Hv, Dv] and each one's pending."""
        conv_inputs, beta, g = inputs
        (committed,) = _gathered(states, "conv")  # [n, C, K-1]
        rows, heads = self._trees_heads(committed, conv_inputs, layout.taps)
        scale = self.shape.key_dim**-0.5
        initials = [state.recurrent for state in states]
        out, solved = solve_trees(heads, g, beta, layout.groups, initials, scale)
        windows, sizes = TreeWindows(rows, layout.taps, layout.indices), layout.sizes
        pending = []
        for tree, inputs_of, piece, size, first in zip(
            layout.parents, conv_inputs.split(sizes), solved, sizes, layout.firsts, strict=True
        ):
            kept = PendingRecurrence(parents=tree, conv_inputs=inputs_of, windows=(windows, first))
            kept.tree_states = TreeStates([piece], size)
            pending.append(kept)
        return out, pending

    def trees_at(
        self,
        inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],  # `_inputs` of S * W rows
        slots: StateSlots,
        index: torch.Tensor,  # [S] each tree's slot of `slots`, on the device
        trees: StaticTrees,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """`factored_mix` of a static tree step's S trees of W nodes each (engine/tree_passes.py,
        a CUDA graph a bucket): their states read at device `index`, nothing written (the
        commit builds them from what is kept). Returns the outputs [S * W, Hv, Dv] and what
        commit reads (`commit_trees_at`): the conv rows [S * (K-1) + S * W, C], then the
        stacked solve's factors (W [S, Hv, W, W], keys, writes, exp(G)), held in the trees'
        arena if they have one (so a layer's temporaries are let go as it ends)."""
        conv_inputs, beta, g = inputs
        rows, heads = self._trees_heads(slots.conv.index_select(0, index), conv_inputs, trees.taps)
        S, W = trees.visible.shape[:2]
        q, k, v, g, beta = (t.unflatten(0, (S, W)) for t in (*heads, g, beta))
        initial = slots.recurrent.index_select(0, index)
        scale = self.shape.key_dim**-0.5
        out, piece = solve_visible(q, k, v, g, beta, trees.visible, initial, scale)
        kept = (rows, *piece.factors)
        return out.flatten(0, 1), kept if trees.arena is None else trees.arena.hold(kept)

    def _trees_heads(
        self,
        committed: torch.Tensor,  # [n, C, K-1] each tree's committed conv window
        conv_inputs: torch.Tensor,  # [sum T_i, C] every tree's tokens
        taps: torch.Tensor,  # [sum T_i, K] each node's window, rows of the conv rows
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Several trees' conv rows (every tree's committed inputs, then every tree's tokens)
        and the heads of their conv outputs: one conv over every tree's windows."""
        rows = torch.cat([committed.transpose(1, 2).flatten(0, 1), conv_inputs])
        return rows, self._heads(conv_at_taps(rows, self.conv1d.weight[:, 0], taps))

    def single_steps(
        self,
        inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],  # `_inputs` of B rows
        states: list[RecurrentState],  # each row's own sequence's
    ) -> torch.Tensor:
        """`tree_mix` of B one-token segments at once (a batched pass's ar steps): each row's
        conv window and delta-rule step against its own state, as one stacked computation,
        committed as it runs (a one-token step's path can only be [0]: its pending is
        `INSTALLED`). A pass holds one layer's state copies at a time, not every layer's
        until commit (at Qwen3.6-27B 3.06 MiB a row, not 146.8). Returns the outputs
        [B, Hv, Dv]."""
        committed, after = _gathered(states, "conv", "recurrent")
        out, windows, after = self._steps(inputs, committed, after)
        install(states, windows, after)
        return out

    def steps_at(
        self,
        inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],  # `_inputs` of B rows
        slots: StateSlots,
        index: torch.Tensor,  # [B] each row's slot of `slots`, on the device
    ) -> torch.Tensor:
        """`single_steps` committed as it runs (a one-token step's path can only be [0]), the
        rows' states read and written at device `index`: a static pass's, the same calls
        whoever's slots they are, which holds one layer's states at a time instead of every
        layer's until commit (at Qwen3.6-27B, 3.06 MiB a row, not 146.8). Rows past the first
        may share its slot (a bucket's padding rows): it is written last. Returns the outputs
        [B, Hv, Dv]."""
        committed, after = (part.index_select(0, index) for part in (slots.conv, slots.recurrent))
        out, windows, after = self._steps(inputs, committed, after)
        for part, new in ((slots.conv, windows), (slots.recurrent, after)):
            part.index_copy_(0, index, new)
            part.index_copy_(0, index[:1], new[:1])
        return out

    def _steps(
        self,
        inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        committed: torch.Tensor,  # [B, C, K-1] each row's conv window, a copy
        after: torch.Tensor,  # [B, Hv, Dk, Dv] each row's delta-rule state, a copy (updated)
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One token a row against its own (gathered) states: outputs [B, Hv, Dv] and the
        states after it (conv windows [B, C, K-1], delta-rule states [B, Hv, Dk, Dv])."""
        conv_inputs, beta, g = inputs
        dt = compute_dtype(conv_inputs.dtype)
        windows = torch.cat([committed, conv_inputs[:, :, None]], dim=2)  # [B, C, K] oldest first
        weight = cast(self.conv1d.weight[:, 0], dt)  # [C, K]
        conv_outputs = cast(F.silu((cast(windows, dt) * weight).sum(dim=-1)), conv_inputs.dtype)
        q, k, v = self._heads(conv_outputs)  # [B, Hv, Dk] x2, [B, Hv, Dv]
        scale = self.shape.key_dim**-0.5
        qf, vf = cast(q, dt) * scale, cast(v, dt)
        # The states' gathered copy [B, Hv, Dk, Dv] is updated in place: decayed, then the
        # rank-1 write as one baddbmm (on the CPU the values of a product, then a sum). At
        # Qwen3.6-27B's widths, six rows: under a third of the time on the CPU, and no
        # state-sized temporaries.
        after = cast(after, dt)
        B, Hv, Dk, Dv = after.shape
        after.mul_(cast(g, dt).exp()[:, :, None, None])
        # Row-vector products (einsum costs ~6x as much host time on the CPU at these sizes).
        recalled = (k[:, :, None, :] @ after)[:, :, 0]  # [B, Hv, Dv]
        delta = (vf - recalled) * cast(beta, dt)[:, :, None]
        after.view(B * Hv, Dk, Dv).baddbmm_(k.reshape(B * Hv, Dk, 1), delta.reshape(B * Hv, 1, Dv))
        out = cast((qf[:, :, None, :] @ after)[:, :, 0], v.dtype)
        return out, windows[:, :, 1:], after

    def extend(self, x: torch.Tensor, state: RecurrentState) -> torch.Tensor:
        """Mix a chain x [T, hidden] (a prefill chunk) and commit all of it into `state` at
        once: nothing per token is kept beyond this call, so a prompt of any length is run in
        chunks with the conv window and the delta-rule state carried from one to the next."""
        return self._output(self.chain_mix(self._inputs(x), state), x)

    def chain_mix(
        self, inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor], state: RecurrentState
    ) -> torch.Tensor:
        """`extend` between the projections: the delta rule's output [T, Hv, Dv] over a chain
        from its projected inputs, committed into `state`."""
        conv_inputs, beta, g = inputs
        T = conv_inputs.shape[0]
        chain = torch.arange(-1, T - 1, device=conv_inputs.device)
        conv_outputs = tree_causal_conv1d(
            conv_inputs, chain, state.conv, self.conv1d.weight[:, 0], None, "silu"
        )
        q, k, v = self._heads(conv_outputs)
        out, final = chain_gated_delta_rule(
            q, k, v, g, beta, state.recurrent, self.shape.key_dim**-0.5
        )
        # In place: a captured graph reads the committed state at its address.
        state.recurrent.copy_(final)
        state.conv.copy_(torch.cat([state.conv, conv_inputs.T], dim=1)[:, -state.conv.shape[1] :])
        return out

    def _inputs(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """conv inputs [T, C], beta [T, Hv] and g [T, Hv] of the normed x [T, hidden]."""
        beta = self.in_proj_b(x).sigmoid()
        dt = compute_dtype(x.dtype)
        # g = log of the per-step decay: -exp(A_log) * softplus(a + dt_bias) <= 0
        g = -cast(self.A_log, dt).exp() * F.softplus(cast(self.in_proj_a(x), dt) + self.dt_bias)
        return self.in_proj_qkv(x), beta, g

    def _output(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The delta rule's output [T, Hv, Dv] gated by z(x), normed, projected: [T, hidden]."""
        s = self.shape
        z = self.in_proj_z(x).view(x.shape[0], s.value_heads, s.value_dim)
        return self.out_proj(self.norm(out, z).reshape(x.shape[0], -1))

    def commit_many(
        self,
        states: list[RecurrentState],
        pendings: list[PendingRecurrence | InstalledStep],
        paths: Sequence[torch.Tensor],
        lasts: list[int],
    ) -> None:
        """Install in each state the one after the last node of its path (`paths`: root-to-node
        paths on the device, read only for a state committed on its own: a `DevicePaths`
        copies each there when first read; `lasts`: their last nodes, on the host). In place: a
        captured graph reads the committed state at its address. A one-token step's pass
        committed it already (`INSTALLED`). Built together, one set of calls a group instead
        of one a sequence: the conv windows of one `factored_mix`'s trees
        (`TreeWindows.commit`) and the states of its trees solved stacked (the CPU's); the
        rest one by one."""
        stacks: dict[int, list[int]] = {}
        windowed: dict[int, list[int]] = {}
        if len(paths) != len(states):
            raise ValueError(f"{len(paths)} paths for {len(states)} states")
        for i, (state, pending) in enumerate(zip(states, pendings, strict=True)):
            if isinstance(pending, InstalledStep):
                if lasts[i] != 0:
                    raise ValueError(f"a one-token step's path ends at node {lasts[i]}, not 0")
                continue
            if pending.windows is not None:
                windowed.setdefault(id(pending.windows[0]), []).append(i)
            else:
                self._commit_conv(state, pending, paths[i])
            piece = pending.tree_states.pieces[0] if pending.tree_states is not None else None
            if piece is not None and piece.stacked is not None:
                stacks.setdefault(id(piece.stacked[0]), []).append(i)
            else:
                self._commit_recurrent(state, pending, paths[i], lasts[i])
        for members in windowed.values():
            windows = pendings[members[0]].windows[0]
            nodes = [pendings[i].windows[1] + lasts[i] for i in members]
            windows.commit(nodes, [states[i] for i in members])
        for members in stacks.values():
            places = [pendings[i].tree_states.pieces[0].stacked for i in members]
            stack = places[0][0]  # (the stack's piece, each tree's index in it)
            mine = [states[i] for i in members]
            (initial,) = _gathered(mine, "recurrent")
            at, nodes = [at for _, at in places], [lasts[i] for i in members]
            windows = pendings[members[0]].windows  # a batched pass's: its indices
            indices = windows[0].indices if windows is not None else None
            install(mine, recurrent=stack.write_states_after(at, nodes, initial, indices))

    def _commit_conv(
        self, state: RecurrentState, pending: PendingRecurrence, accepted: torch.Tensor
    ) -> None:
        """The conv window after the path: its last K-1 inputs."""
        path_inputs = pending.conv_inputs[accepted].T  # [C, K_acc]
        state.conv.copy_(torch.cat([state.conv, path_inputs], dim=1)[:, -state.conv.shape[1] :])

    def _commit_recurrent(
        self, state: RecurrentState, pending: PendingRecurrence, accepted: torch.Tensor, last: int
    ) -> None:
        """The delta-rule state after the path, by what the pass kept."""
        if pending.node_states is not None:  # by selection
            state.recurrent.copy_(pending.node_states.index_select(0, accepted[-1:])[0])
            return
        if pending.tree_states is not None:
            pending.tree_states.write_state_after(last, state.recurrent)
            return
        for piece in accepted.split(REPLAY_PIECE):
            # The kernel hands back every node's state: re-running a long path (a prefill) in
            # pieces keeps that to REPLAY_PIECE states at a time.
            chain = torch.arange(-1, piece.shape[0] - 1, device=piece.device)
            q, k, v = self._heads(pending.conv_outputs[piece])
            _, piece_states = tree_gated_delta_rule(
                q,
                k,
                v,
                pending.g[piece],
                pending.beta[piece],
                chain,
                state.recurrent,
                self.shape.key_dim**-0.5,
                return_states=True,
            )
            state.recurrent.copy_(piece_states[-1])

    def _heads(
        self,
        conv_outputs: torch.Tensor,  # [T, C]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Split the conv output into per-value-head q, k (L2-normalised) and v."""
        T = conv_outputs.shape[0]
        s = self.shape
        qk_dim = s.key_heads * s.key_dim
        q, k, v = conv_outputs.split([qk_dim, qk_dim, s.value_heads * s.value_dim], dim=-1)
        dt = compute_dtype(conv_outputs.dtype)
        repeat = s.value_heads // s.key_heads  # key head h serves value heads h*repeat ..
        q = l2norm(cast(q.reshape(T, s.key_heads, s.key_dim), dt)).repeat_interleave(repeat, dim=1)
        k = l2norm(cast(k.reshape(T, s.key_heads, s.key_dim), dt)).repeat_interleave(repeat, dim=1)
        return q, k, v.reshape(T, s.value_heads, s.value_dim)


def conv_taps(parents: torch.Tensor, kernel: int) -> torch.Tensor:  # [T, K]
    """Each node's conv window (oldest first) as columns of [committed K-1 inputs ; the T
    pending], walking parents on the device: a static verify's tree, computed once a pass and
    shared by its GDN layers (a batched pass's trees: `trees_layout`)."""
    window, T = kernel - 1, parents.shape[0]
    device = parents.device
    previous = torch.cat(
        [
            torch.arange(-1, window - 1, device=device),
            torch.where(parents >= 0, parents + window, window - 1),
        ]
    )  # [K-1 + T] each column's predecessor on its path
    taps = [torch.arange(window, window + T, device=device)]
    for _ in range(window):
        taps.append(previous[taps[-1]])
    return torch.stack(taps[::-1], dim=1)


@dataclass(frozen=True)
class TreesLayout:
    """A batched pass's trees solved together (`factored_mix`), as each of its GDN layers reads
    them, made once a pass (`trees_layout`): the conv rows are every tree's committed K-1
    inputs (tree by tree, oldest first), then every tree's tokens; `taps` is each node's
    window in them; the trees by size, as `solve_trees` stacks them."""

    parents: list[np.ndarray]  # each tree's [T_i], on the host (its commit checks paths on it)
    sizes: list[int]
    firsts: list[int]  # each tree's first row among the trees' rows
    taps: torch.Tensor  # [sum T_i, K] each node's window, rows of the conv rows, oldest first
    groups: list[SizeGroup]
    indices: DeviceIndices  # what its layers' commits index with, copied once for them all


def trees_layout(
    parents: list[np.ndarray],  # each tree's [T_i], on the host
    visible: list[torch.Tensor],  # each tree's [T_i, T_i] ancestor mask, on the device
    kernel: int,
) -> TreesLayout:
    """The layout of a batched pass's trees: each node's conv window walked on the host, one
    copy to the device for them all (`conv_taps` is one tree's, walked on the device)."""
    sizes = [len(tree) for tree in parents]
    firsts = [0, *itertools.accumulate(sizes)][:-1]
    device = visible[0].device
    windows = to_device(trees_taps(parents, kernel), device)
    groups = size_groups(sizes, visible)
    return TreesLayout(parents, sizes, firsts, windows, groups, DeviceIndices(device))


def trees_taps(parents: list[np.ndarray], kernel: int) -> np.ndarray:  # [sum T_i, K]
    """Each node's conv window (oldest first) as rows of several trees' conv rows: every
    tree's committed K-1 inputs (tree by tree), then every tree's tokens; walked on the host
    (`conv_taps` walks one tree's on the device)."""
    window, n = kernel - 1, len(parents)
    sizes = [len(tree) for tree in parents]
    previous = np.arange(-1, n * window + sum(sizes) - 1)  # each row's predecessor on its path
    base = n * window
    for i, tree in enumerate(parents):  # a root follows its tree's last committed input
        previous[base : base + len(tree)] = np.where(tree >= 0, tree + base, (i + 1) * window - 1)
        base += len(tree)
    taps = [np.arange(n * window, len(previous))]
    for _ in range(window):
        taps.append(previous[taps[-1]])
    return np.stack(taps[::-1], axis=1)


def windows_after(
    rows: torch.Tensor,  # [N, C] several trees' conv rows (`trees_taps`)
    taps: torch.Tensor,  # [sum T_i, K] each node's window, rows of `rows`
    nodes: torch.Tensor,  # [n] nodes (rows of `taps`), on the device
) -> torch.Tensor:  # [n, C, K-1]
    """The conv state after each of `nodes`: its window but the oldest input."""
    ends = taps.index_select(0, nodes)[:, 1:]
    picked = rows.index_select(0, ends.reshape(-1))  # [n * (K-1), C]
    return picked.view(nodes.shape[0], -1, rows.shape[1]).transpose(1, 2)


@dataclass(frozen=True)
class TreeEnds:
    """Where a static tree step's commit (`commit_trees_at`) ends each tree, in device
    buffers: row j installs in state slot `slots[j]` the state after node `lasts[j]` of tree
    `trees[j]` of the pass. Rows past the step's commits repeat its first (the same values
    written to its slot again)."""

    trees: torch.Tensor  # [S]
    lasts: torch.Tensor  # [S]
    slots: torch.Tensor  # [S]


def commit_trees_at(
    kept: tuple[torch.Tensor, ...],  # a GDN layer's `trees_at`: conv rows, the factors
    slots: StateSlots,
    taps: torch.Tensor,  # [S * W, K] the pass's node windows
    ends: TreeEnds,
) -> None:
    """`commit_many` of a static tree step's GDN layer with static shapes (a CUDA graph a
    bucket: engine/tree_passes.py): each row's conv window and delta-rule state after its
    tree's last accepted node, built from what the pass kept and the committed state, written
    at its slot."""
    rows, *factors = kept
    nodes = ends.trees * factors[0].shape[-1] + ends.lasts
    windows = windows_after(rows, taps, nodes)
    initial = slots.recurrent.index_select(0, ends.slots)
    after = SolvedPiece(tuple(factors), None).states_after_at(ends.trees, ends.lasts, initial)
    slots.conv.index_copy_(0, ends.slots, windows)
    slots.recurrent.index_copy_(0, ends.slots, after)


def conv_at_taps(
    rows: torch.Tensor,  # [N, C] the inputs the windows read: committed K-1, then pending
    weight: torch.Tensor,  # [C, K]
    taps: torch.Tensor,  # [T, K] rows of each node's window (see conv_taps)
) -> torch.Tensor:  # [T, C]
    """silu(depthwise causal conv) of each node over its window, `reference.tree_causal_conv1d`
    with the windows given. The windows are gathered as whole rows: on the CPU ~5x faster than
    gathering the columns of a [C, N] layout (contiguous copies, not a strided gather). One
    index_select of the flattened taps and a contiguous [K, C] weight, multiplied in place: at
    96 rows of the demo's widths 94 us against 293-369 us for an advanced index and a product
    with the transposed view (the same values: the same products, summed in the same order)."""
    dt = compute_dtype(rows.dtype)
    T, K = taps.shape
    windows = cast(rows, dt).index_select(0, taps.reshape(-1)).view(T, K, -1)  # [T, K, C]
    return cast(F.silu(windows.mul_(cast(weight, dt).T.contiguous()).sum(dim=1)), rows.dtype)


def window_rows(conv_state: torch.Tensor, x: torch.Tensor) -> torch.Tensor:  # [K-1 + T, C]
    """The rows `conv_at_taps` reads for one tree: the committed conv state [C, K-1] (oldest
    first), then the pending inputs x [T, C]."""
    return torch.cat([conv_state.T, x])


def solve_visible(
    q: torch.Tensor,  # [..., T, H, Dk]
    k: torch.Tensor,  # [..., T, H, Dk]
    v: torch.Tensor,  # [..., T, H, Dv]
    g: torch.Tensor,  # [..., T, H]
    beta: torch.Tensor,  # [..., T, H]
    visible: torch.Tensor,  # [..., T, T] bool ancestor-or-self
    initial_state: torch.Tensor,  # [..., H, Dk, Dv]
    scale: float,
) -> tuple[torch.Tensor, SolvedPiece]:  # outputs [..., T, H, Dv] in v's dtype
    """The batched solve of a tree whose ancestor mask is already on the device (solve_tree
    builds it from parents on the host); trees of one size may be stacked on a leading
    dimension, each with its own mask and state."""
    dt = compute_dtype(v.dtype)
    qkv = [cast(t, dt).transpose(-3, -2) for t in (q * scale, k, v)]
    heads_first = [*qkv, *(cast(t, dt).transpose(-2, -1) for t in (g, beta))]
    out, piece = solve_piece(*heads_first, visible, cast(initial_state, dt))
    return cast(out.transpose(-3, -2), v.dtype), piece


@dataclass(frozen=True)
class SizeGroup:
    """Trees of one size that `solve_trees` stacks: their indices, their rows among the trees'
    (None: every tree, in order) and their ancestor masks stacked [n, size, size]."""

    size: int
    members: list[int]
    rows: torch.Tensor | None
    visible: torch.Tensor


def size_groups(sizes: list[int], visible: list[torch.Tensor]) -> list[SizeGroup]:
    """The trees of sizes `sizes` (each its [T_i, T_i] ancestor mask) by size, as
    `solve_trees` stacks them: made once a batched pass, read by each of its GDN layers."""
    by_size: dict[int, list[int]] = {}
    for i, size in enumerate(sizes):
        by_size.setdefault(size, []).append(i)
    if len(by_size) == 1:  # every tree one size, in order: the rows stack as they are
        return [SizeGroup(sizes[0], list(range(len(sizes))), None, torch.stack(visible))]
    starts, device = np.cumsum([0, *sizes]), visible[0].device
    groups = []
    for size, members in by_size.items():
        index = np.concatenate([np.arange(starts[i], starts[i] + size) for i in members])
        masks = torch.stack([visible[i] for i in members])
        groups.append(SizeGroup(size, members, to_device(index, device), masks))
    return groups


def solve_trees(
    heads: tuple[torch.Tensor, torch.Tensor, torch.Tensor],  # q, k, v of every tree's rows
    g: torch.Tensor,  # [sum T_i, H]
    beta: torch.Tensor,  # [sum T_i, H]
    groups: list[SizeGroup],  # the trees by size (`size_groups`)
    initials: list[torch.Tensor],  # each tree's state [H, Dk, Dv]
    scale: float,
) -> tuple[torch.Tensor, list[SolvedPiece]]:  # outputs [sum T_i, H, Dv], each tree's piece
    """`solve_visible` of several trees, those of one size stacked and solved together (a
    batched pass's verify trees: one set of calls per size, not per tree)."""
    if len(groups) == 1 and groups[0].rows is None:
        solved, pieces = _solve_stacked(heads, g, beta, groups[0], initials, scale)
        return solved.flatten(0, 1), pieces
    out = torch.empty_like(heads[2])
    found: list[SolvedPiece | None] = [None] * len(initials)
    for group in groups:
        rows = [t.index_select(0, group.rows) for t in (*heads, g, beta)]
        states = [initials[i] for i in group.members]
        solved, pieces = _solve_stacked(rows[:3], *rows[3:], group, states, scale)
        out.index_copy_(0, group.rows, solved.flatten(0, 1))
        for i, piece in zip(group.members, pieces, strict=True):
            found[i] = piece
    return out, found


def _solve_stacked(
    heads, g, beta, group: SizeGroup, initials: list, scale: float
) -> tuple[torch.Tensor, list[SolvedPiece]]:  # outputs [n, size, H, Dv], each tree's piece
    """`solve_trees` of the trees of one size, their rows following one another."""
    n, dt = len(initials), compute_dtype(heads[2].dtype)
    q, k, v, g, beta = (t.unflatten(0, (n, group.size)) for t in (*heads, g, beta))
    states = cast(torch.stack(initials), dt)
    solved, stacked = solve_visible(q, k, v, g, beta, group.visible, states, scale)
    return solved, stacked.unstack(initials)


def pending_from(
    keep: str, kept: tuple[torch.Tensor, ...], state: RecurrentState
) -> PendingRecurrence:
    """The PendingRecurrence of what `forward_static` kept under `keep`."""
    conv_inputs, *rest = kept
    keep = keep_for(keep, conv_inputs.shape[0])
    pending = PendingRecurrence(parents=None, conv_inputs=conv_inputs)
    if keep == "factored":
        piece = SolvedPiece(tuple(rest), initial=state.recurrent)
        pending.tree_states = TreeStates([piece], conv_inputs.shape[0])
    elif keep == "snapshot":
        (pending.node_states,) = rest
    else:
        pending.conv_outputs, pending.g, pending.beta = rest
    return pending


def keep_for(keep: str, tokens: int) -> str:
    """`keep` for a pass of `tokens`: a snapshot sized by `choose_keep` for at most
    STATIC_VERIFY_TOKENS, so a wider verify (a budget above 15) replays instead."""
    return "replay" if keep == "snapshot" and tokens > STATIC_VERIFY_TOKENS else keep


def choose_keep(shape: GDNShape, layers: int, weight: torch.Tensor) -> str:
    """What a static verify keeps for commit: "factored" with the CPU's batched kernels; on
    CUDA "snapshot" (commit by selection) when a STATIC_VERIFY_TOKENS round's per-node states
    take at most SNAPSHOT_HEADROOM of the free device memory, else "replay"."""
    backend = backend_for(weight)
    if backend == "batched":
        return "factored"
    if backend == "triton":
        snapshot = pending_bytes(shape, layers, STATIC_VERIFY_TOKENS, "snapshot", weight.dtype)
        free, _ = torch.cuda.mem_get_info(weight.device)
        if snapshot <= SNAPSHOT_HEADROOM * free:
            return "snapshot"
    return "replay"


def choose_strategy(
    shape: GDNShape, tokens: int, state_dtype: torch.dtype, backend: str = "triton"
) -> StateStrategy:
    """What "auto" means for a pass of `tokens` tokens whose kernels come from `backend`.

    With the batched torch kernels "factored" while its factors fit in SNAPSHOT_LIMIT_BYTES (a
    verify round; a short prefill); otherwise "snapshot" when `tokens` per-node states fit
    there, else "replay".
    """
    if backend == "batched" and factored_fits(shape, tokens, state_dtype):
        return "factored"
    state_bytes = shape.value_heads * shape.key_dim * shape.value_dim * state_dtype.itemsize
    return "snapshot" if tokens * state_bytes <= SNAPSHOT_LIMIT_BYTES else "replay"


def factored_fits(shape: GDNShape, tokens: int, state_dtype: torch.dtype) -> bool:
    """Whether a `tokens`-token pass's factors fit in SNAPSHOT_LIMIT_BYTES a layer: on the CPU
    any pass's "auto", on every device a batched pass's trees (solved together, one set of
    calls a layer, where a kernel a tree would run per sequence: engine/models/qwen3_5.py)."""
    return factored_bytes(shape, tokens, state_dtype) <= SNAPSHOT_LIMIT_BYTES


def factored_bytes(shape: GDNShape, tokens: int, state_dtype: torch.dtype) -> int:
    """Bytes one layer's factors of a `tokens`-token pass hold (engine/memory_plan.py counts them)."""
    factors = factored_elements(shape.value_heads, shape.key_dim, shape.value_dim, tokens)
    return factors * state_dtype.itemsize


def pending_bytes(
    shape: GDNShape, layers: int, tokens: int, strategy: StateStrategy, dtype: torch.dtype
) -> int:
    """Extra memory one verify round of `tokens` keeps for commit in `layers` GDN layers."""
    model_bytes = torch.empty(0, dtype=dtype).element_size()
    state_dtype = compute_dtype(dtype)
    state_bytes = torch.empty(0, dtype=state_dtype).element_size()
    per_layer = shape.conv_dim * model_bytes * tokens  # conv inputs: every strategy
    if strategy == "snapshot":
        per_layer += shape.value_heads * shape.key_dim * shape.value_dim * state_bytes * tokens
    elif strategy == "factored":
        per_layer += factored_bytes(shape, tokens, state_dtype)
    else:  # conv outputs, beta (model dtype) and g (compute dtype)
        per_layer += (
            (shape.conv_dim + shape.value_heads) * model_bytes + shape.value_heads * state_bytes
        ) * tokens
    return per_layer * layers


def qwen36_27b_shape() -> GDNShape:
    """The GDN layers of Qwen3.6-27B (48 of its 64 layers)."""
    return GDNShape(
        hidden_size=5120,
        key_heads=16,
        value_heads=48,
        key_dim=128,
        value_dim=128,
        conv_kernel=4,
        eps=1e-6,
    )


if __name__ == "__main__":  # python -m engine.models.gated_deltanet: memory per round at 27B
    for strategy in ("replay", "snapshot", "factored"):
        for dtype in (torch.bfloat16, torch.float32):
            size = pending_bytes(qwen36_27b_shape(), 48, 16, strategy, dtype)
            print(
                f"{strategy:8s} {str(dtype):15s} {size / 2**20:8.1f} MiB per 16-token verify round"
            )
