"""The hybrid target Qwen3.5 / Qwen3.6: Gated DeltaNet layers + gated full attention, tree-aware.

Layer i is "linear_attention" (a Gated DeltaNet, engine/models/gated_deltanet.py) or
"full_attention" (GQA whose q_proj is twice as wide: the query and a sigmoid output gate;
q/k RMSNorm; RoPE on the first `partial_rotary_factor` of each head). Every RMSNorm outside the
GDN scales by (1 + weight), as in transformers' Qwen3_5RMSNorm. Text-only positions make the
checkpoints' multimodal RoPE (mrope) the plain RoPE used here: its three position streams are
equal.

The target interface shared with the dense model (see engine/decode.py):
    cache = model.new_cache(max_len)
    logits, hidden = model.forward(ids [T], cache, parents [T] | None, hidden_layers)
    model.commit(cache, accepted [K])
    logits, hidden = model.extend(ids [T], cache, hidden_layers)  # a prefill chunk, committed
    logits, hidden, pending = model.forward_static(inputs, cache, keys, hidden_layers)
    model.commit(cache, accepted [K] | list, pending)  # after forward_static
A forward runs a tree of pending tokens (parents[i] < i, or -1 = child of the last committed
token) without touching the committed state; attention layers write the pending K/V behind the
committed prefix, GDN layers keep what commit needs (see gated_deltanet.py for the two
strategies). `forward_static` is the graph-safe verify / ar step (static shapes, device-side
lengths, see engine/decode.py): it returns what each GDN layer keeps for commit instead of
storing it, and keeps what `cache.keep` names ("factored" with the CPU kernels; on CUDA
"snapshot", commit by selection, when `choose_keep` finds the per-node states fit, else
"replay"). `load_qwen3_5(path)` reads `qwen3_5_text` checkpoints and the text part of
`qwen3_5` multimodal ones.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from engine import kernels
from engine.kernels.reference import cast, compute_dtype
from engine.kv_blocks import KVBlockPool, KVLayout, commit_paths
from engine.memory_plan import FULL, LINEAR, hybrid_layer_types
from engine.models.common import (
    BatchOutputs,
    GrowingPass,
    KVCache,
    Rotary,
    ScoreFn,
    Segment,
    SegmentsPass,
    StepInputs,
    SwiGLU,
    WindowPass,
    finish_loading,
    new_kv_cache,
    read_config,
    rope_theta,
    score_positions,
    segment_layout,
    segment_parents,
    split_batch,
    undrawn_embedding,
)
from engine.models.gated_deltanet import (
    INSTALLED,
    STATE_STRATEGIES,
    GatedDeltaNet,
    GDNShape,
    PendingRecurrence,
    RecurrentState,
    StateStrategy,
    TreeEnds,
    TreesLayout,
    choose_keep,
    commit_trees_at,
    conv_taps,
    factored_fits,
    pending_from,
    trees_layout,
)
from engine.transfer import DeviceIndices, on_device, to_device
from engine.tree import DevicePaths, TreeInputs, tree_layout

MULTIMODAL_TEXT_PREFIX = "model.language_model."  # `qwen3_5` checkpoints (vision + text)
TEXT_PREFIX = "model."  # `qwen3_5_text` checkpoints


@dataclass(frozen=True)
class Qwen3_5Config:
    """The fields of a `qwen3_5_text` config.json (or a `qwen3_5` one's text_config) we use."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.25
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768  # the served context limit by default

    @classmethod
    def from_hf(cls, config: dict) -> Qwen3_5Config:
        """From a config.json dict: `qwen3_5_text`, or `qwen3_5` (its text_config is read)."""
        text = config.get("text_config", config)
        names = cls.__dataclass_fields__.keys() - {
            "layer_types",
            "rope_theta",
            "tie_word_embeddings",
        }
        fields = {name: text[name] for name in names if name in text}
        rope = text.get("rope_parameters") or {}
        if "partial_rotary_factor" in rope:
            fields["partial_rotary_factor"] = rope["partial_rotary_factor"]
        return cls(
            **fields,
            layer_types=hybrid_layer_types(text),
            rope_theta=rope_theta(text),
            tie_word_embeddings=config.get(
                "tie_word_embeddings", text.get("tie_word_embeddings", False)
            ),
        )

    def gdn_shape(self) -> GDNShape:
        return GDNShape(
            hidden_size=self.hidden_size,
            key_heads=self.linear_num_key_heads,
            value_heads=self.linear_num_value_heads,
            key_dim=self.linear_key_head_dim,
            value_dim=self.linear_value_head_dim,
            conv_kernel=self.linear_conv_kernel_dim,
            eps=self.rms_norm_eps,
        )


class ZeroCenteredRMSNorm(nn.Module):
    """(1 + weight) * x / rms(x), all in float32 (float64 for float64), like HF Qwen3_5RMSNorm."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # one fused kernel on CUDA
        return kernels.rms_norm(x, self.weight, self.eps, zero_centered=True)


@dataclass
class HybridCache:
    """Committed state of the hybrid target: K/V of the attention layers, GDN states.

    `pending` holds, per GDN layer, what the last forward left for `commit`.
    """

    kv: KVCache
    recurrent: list[RecurrentState]
    pending: list[PendingRecurrence] = field(default_factory=list)
    keep: str = "replay"  # what forward_static keeps for commit (see gated_deltanet.choose_keep)

    @property
    def length(self) -> int:
        return self.kv.length

    @property
    def max_len(self) -> int:
        return self.kv.max_len

    def check_room(self, pending: int) -> None:
        self.kv.check_room(pending)

    def reset(self) -> None:
        """Empty: no token committed, every GDN state zero (a pooled cache's next sequence)."""
        self.kv.reset()
        for state in self.recurrent:
            state.conv.zero_()
            state.recurrent.zero_()
        self.pending = []

    def read_states(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A copy of every GDN layer's conv window [G, C, K-1] and recurrent state
        [G, Hv, Dk, Dv]: the state at exactly `length` committed tokens."""
        return (
            torch.stack([state.conv for state in self.recurrent]),
            torch.stack([state.recurrent for state in self.recurrent]),
        )

    def place_states(self, saved: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Install a `read_states` copy, in place (captured graphs read the states' storage)."""
        conv, recurrent = saved
        for index, state in enumerate(self.recurrent):
            state.conv.copy_(conv[index])
            state.recurrent.copy_(recurrent[index])
        self.pending = []


@dataclass(frozen=True)
class MixGroup:
    """Segments of a batched pass that its GDN layers mix together (its one-token steps, or its
    trees solved factored), made once a pass: their indices, their rows of the pass (None:
    every segment, in order) and, for trees, their layout."""

    members: list[int]
    rows: torch.Tensor | None
    layout: TreesLayout | None = None


@dataclass
class TreePass:
    """Everything the layers of one forward share: the tree, RoPE tables and the cache; what
    the GDN layers leave for commit is collected in `pending`."""

    cache: HybridCache | None  # None: a static batched step (`steps`)
    parents: torch.Tensor  # [T] (a chain when the caller gave none)
    attention: GrowingPass | WindowPass | SegmentsPass | StepInputs
    cos: torch.Tensor  # [T, rotary_dim]
    sin: torch.Tensor  # [T, rotary_dim]
    rotary: Rotary
    extend: bool = False  # a chain committed as it runs (a prefill chunk): nothing pending
    static: TreeInputs | None = None  # forward_static: the device-side tree
    taps: torch.Tensor | None = None  # each node's conv window (conv_taps): forward_static's,
    # made once for all its GDN layers (a batched pass's trees: `groups`)
    pending: list = field(default_factory=list)
    parts: list[tuple[slice, TreePass]] = field(default_factory=list)  # forward_batch: rows and
    # each segment's own pass (its cache, tree and pending), which its GDN layers run on
    ancestors: torch.Tensor | None = None  # a batched pass's tree segment solved "factored":
    # its ancestor mask [T, T], made once for all its GDN layers
    groups: list[MixGroup] = field(default_factory=list)  # forward_batch: the segments its GDN
    # layers mix together, made once for them all
    steps: StepInputs | None = None  # forward_steps: every row one sequence's token


class GatedAttention(nn.Module):
    """Full attention with a sigmoid output gate, q/k RMSNorm and partial RoPE."""

    def __init__(self, config: Qwen3_5Config) -> None:
        super().__init__()
        c = config
        self.heads, self.kv_heads, self.head_dim = (
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
        )
        self.q_proj = nn.Linear(c.hidden_size, 2 * c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)
        self.q_norm = ZeroCenteredRMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(c.head_dim, c.rms_norm_eps)

    def forward(self, x: torch.Tensor, tree: TreePass, slot: int) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; writes this layer's pending K/V in cache slot `slot`."""
        T = x.shape[0]
        query_gate = self.q_proj(x).view(T, self.heads, 2 * self.head_dim)
        q, gate = query_gate.chunk(2, dim=-1)  # [T, Hq, D] each
        q = tree.rotary.apply(self.q_norm(q), tree.cos, tree.sin)
        k = self.k_norm(self.k_proj(x).view(T, self.kv_heads, self.head_dim))
        k = tree.rotary.apply(k, tree.cos, tree.sin)  # [T, Hkv, D]
        v = self.v_proj(x).view(T, self.kv_heads, self.head_dim)
        kv = tree.cache.kv if tree.cache is not None else None
        out = tree.attention.attend(kv, slot, q, k, v, self.head_dim**-0.5)
        out = out.reshape(T, -1) * torch.sigmoid(gate.reshape(T, -1))
        return self.o_proj(out)


class HybridDecoderLayer(nn.Module):
    """Pre-norm mixer (GDN or gated attention) + SwiGLU MLP, with residuals."""

    def __init__(self, config: Qwen3_5Config, layer_type: str, slot: int) -> None:
        super().__init__()
        self.layer_type = layer_type
        self.slot = slot  # index among the layers of the same type (its cache entry)
        if layer_type == LINEAR:
            self.linear_attn = GatedDeltaNet(config.gdn_shape())
        elif layer_type == FULL:
            self.self_attn = GatedAttention(config)
        else:
            raise ValueError(f"unknown layer type {layer_type!r}")
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)
        self.input_layernorm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h: torch.Tensor, tree: TreePass, strategy: StateStrategy) -> torch.Tensor:
        normed = self.input_layernorm(h)
        if self.layer_type != LINEAR:
            mixed = self.self_attn(normed, tree, self.slot)
        elif tree.steps is not None:
            mixed = self._mix_steps(normed, tree)
        elif tree.parts:  # a batched pass: each segment's GDN state on its own
            mixed = self._mix_parts(normed, tree, strategy)
        else:
            mixed = self._mix(normed, tree, strategy)
        h = h + mixed
        return h + self.mlp(self.post_attention_layernorm(h))

    def _mix_steps(self, normed: torch.Tensor, tree: TreePass) -> torch.Tensor:
        """The GDN mixer over a static batched step: every row against its own state slot,
        committed as it runs (`steps_at`), or every tree against its own, the factors kept
        for commit (`trees_at`)."""
        gdn, steps = self.linear_attn, tree.steps
        inputs, slots = gdn._inputs(normed), steps.slots[self.slot]
        if steps.trees is None:
            return gdn._output(gdn.steps_at(inputs, slots, steps.states), normed)
        out, kept = gdn.trees_at(inputs, slots, steps.states, steps.trees)
        tree.pending.append(kept)
        return gdn._output(out, normed)

    def _mix_parts(
        self, normed: torch.Tensor, tree: TreePass, strategy: StateStrategy
    ) -> torch.Tensor:
        """The GDN mixer over a batched pass: every row projected at once, each segment's rows
        mixed against its own state (a chain committed, or a tree left pending): its one-token
        steps stacked, its factored trees solved together (`tree.groups`), the rest alone."""
        gdn, parts = self.linear_attn, tree.parts
        inputs = gdn._inputs(normed)
        outs: list[torch.Tensor | None] = [None] * len(parts)
        for group in tree.groups:
            rows = group.rows
            mine = inputs if rows is None else tuple(t.index_select(0, rows) for t in inputs)
            states = [parts[i][1].cache.recurrent[self.slot] for i in group.members]
            if group.layout is None:  # one-token steps, committed as they run
                out, pending = gdn.single_steps(mine, states), [INSTALLED] * len(states)
            else:
                out, pending = gdn.factored_mix(mine, states, group.layout)
            for i, kept in zip(group.members, pending, strict=True):
                parts[i][1].pending.append(kept)
            if rows is None:
                return gdn._output(out, normed)
            sizes = [parts[i][0].stop - parts[i][0].start for i in group.members]
            for i, mixed in zip(group.members, out.split(sizes), strict=True):
                outs[i] = mixed
        for i, (rows, part) in enumerate(parts):
            if outs[i] is not None:
                continue
            mine = tuple(tensor[rows] for tensor in inputs)
            state = part.cache.recurrent[self.slot]
            if part.extend:
                outs[i] = gdn.chain_mix(mine, state)
                continue
            outs[i], pending = gdn.tree_mix(mine, state, part.parents, strategy)
            part.pending.append(pending)
        return gdn._output(torch.cat(outs), normed)

    def _mix(self, normed: torch.Tensor, tree: TreePass, strategy: StateStrategy) -> torch.Tensor:
        """The GDN mixer over one sequence's tokens, against its own state."""
        state = tree.cache.recurrent[self.slot]
        if tree.extend:
            return self.linear_attn.extend(normed, state)
        if tree.static is not None:
            mixed, kept = self.linear_attn.forward_static(
                normed, state, tree.static, tree.cache.keep, tree.taps
            )
            tree.pending.append(kept)
            return mixed
        mixed, pending = self.linear_attn(normed, state, tree.parents, strategy)
        tree.pending.append(pending)
        return mixed


class Qwen3_5Model(nn.Module):
    """The hybrid causal LM (batch 1, no batch dimension) with the engine's target interface."""

    def __init__(self, config: Qwen3_5Config, state_strategy: StateStrategy = "auto") -> None:
        super().__init__()
        if state_strategy not in STATE_STRATEGIES:
            raise ValueError(f"state_strategy must be one of {STATE_STRATEGIES}")
        self.config = config
        self.state_strategy = state_strategy
        self.embed_tokens = undrawn_embedding(config.vocab_size, config.hidden_size)
        slots = {LINEAR: 0, FULL: 0}
        layers = []
        for layer_type in config.layer_types:
            layers.append(HybridDecoderLayer(config, layer_type, slots[layer_type]))
            slots[layer_type] += 1
        self.layers = nn.ModuleList(layers)
        self.norm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()
        self.rotary = Rotary(config.head_dim, config.rope_theta, config.partial_rotary_factor)

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings and isinstance(self.lm_head, nn.Linear):
            self.lm_head.weight = (
                self.embed_tokens.weight
            )  # (a tensor-parallel shard may have none)

    def _layers_of(self, layer_type: str) -> list[HybridDecoderLayer]:
        return [layer for layer in self.layers if layer.layer_type == layer_type]

    def kv_layout(self) -> KVLayout:
        """The K/V geometry of the attention layers (a KV block pool's, engine/kv_blocks.py)."""
        c, weight = self.config, self.embed_tokens.weight
        layers = len(self._layers_of(FULL))
        return KVLayout(layers, c.num_key_value_heads, c.head_dim, weight.dtype, weight.device)

    def new_cache(self, max_len: int, blocks: KVBlockPool | None = None) -> HybridCache:
        """K/V for max_len tokens (a block table over `blocks`, else contiguous), GDN states."""
        c, weight = self.config, self.embed_tokens.weight
        kv = new_kv_cache(self.kv_layout(), max_len, blocks)
        gdn = self._layers_of(LINEAR)
        recurrent = [layer.linear_attn.new_state(weight.dtype, weight.device) for layer in gdn]
        keep = choose_keep(c.gdn_shape(), len(gdn), weight)
        return HybridCache(kv=kv, recurrent=recurrent, keep=keep)

    def share_states(self, caches: list[HybridCache]) -> None:
        """Move the GDN states of `caches` (a scheduler's slots) into one `StateSlots` a
        layer, their values kept: a batched pass's one-token steps then read and commit all of
        them at once. The old states are dropped: a pass captured over them is stale."""
        weight = self.embed_tokens.weight
        indices = DeviceIndices(weight.device)  # every layer's slots: the same sequences
        for slot, layer in enumerate(self._layers_of(LINEAR)):
            shared = layer.linear_attn.new_states(len(caches), weight.dtype, weight.device, indices)
            for cache, state in zip(caches, shared, strict=True):
                state.conv.copy_(cache.recurrent[slot].conv)
                state.recurrent.copy_(cache.recurrent[slot].recurrent)
                cache.recurrent[slot] = state

    @torch.no_grad()
    def forward(
        self,
        ids: torch.Tensor,  # [T]
        cache: HybridCache,
        parents: torch.Tensor | None = None,  # [T]; None = a chain
        hidden_layers: Sequence[int] = (),
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [T, V] (float32; float64 for float64 models) and the requested layers' outputs.

        Token i sits at position cache.length + depth(i) and sees the committed prefix, its
        ancestors and itself. The committed state is left as it is until `commit`.
        """
        h, hidden = self._run(ids, cache, parents, hidden_layers, extend=False)
        return self.logits(h), hidden

    @torch.no_grad()
    def forward_static(
        self,
        inputs: TreeInputs,
        cache: HybridCache,
        keys: int,
        hidden_layers: Sequence[int] = (),
    ) -> tuple[torch.Tensor, torch.Tensor | None, tuple]:
        """`forward` of inputs.ids at device length inputs.length with static shapes: attention
        reads `keys` cache slots; returns (logits, hidden, what each GDN layer keeps)."""
        h = self.embed_tokens(inputs.ids)
        cos, sin = self.rotary.tables(inputs.length + inputs.depths, h.dtype)
        attention = WindowPass(inputs.slots(), inputs.length, inputs.visible, keys)
        kernel = self.config.linear_conv_kernel_dim
        taps = conv_taps(inputs.parents, kernel) if cache.keep == "factored" else None
        tree = TreePass(
            cache, inputs.parents, attention, cos, sin, self.rotary, static=inputs, taps=taps
        )
        h, hidden = self._layers(h, tree, hidden_layers)
        return self.logits(h), hidden, tuple(tree.pending)

    @torch.no_grad()
    def extend(
        self,
        ids: torch.Tensor,
        cache: HybridCache,
        hidden_layers: Sequence[int] = (),
        score: ScoreFn | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the chain `ids` (a prefill chunk) and commit all of it as it goes: K/V written in
        place, each GDN layer's conv window and state carried forward. Logits [1, V] of the
        last token only (`score`: also every position's, a slice at a time, see
        `score_positions`); the requested layers' outputs of every token."""
        h, hidden = self._run(ids, cache, None, hidden_layers, extend=True)
        cache.kv.advance(ids.shape[0])
        if score is not None:
            score_positions(h, self.logits, score)
        return self.logits(h[-1:]), hidden

    @torch.no_grad()
    def forward_batch(
        self, segments: list[Segment], hidden_layers: Sequence[int] = ()
    ) -> BatchOutputs:
        """Several sequences' `forward` (or `extend`, a prefill piece) in one pass: their tokens
        flattened through the embeddings, projections, MLPs and lm_head; each segment's
        attention against its own K/V and its GDN layers on its own states. Per segment:
        logits (its last token's for a prefill piece, committed; every token's for a verify,
        left pending for `commit`); the pass's hidden rows."""
        device = self.embed_tokens.weight.device
        for segment in segments:
            segment.cache.kv.check_room(segment.ids.shape[0])
        lengths = [segment.cache.length for segment in segments]
        rows, positions, passes = segment_layout(segments, lengths, device)
        h = self.embed_tokens(torch.cat([segment.ids for segment in segments]))
        cos, sin = self.rotary.tables(positions, h.dtype)
        kv = [segment.cache.kv for segment in segments]
        parts = [
            (r, self._segment_pass(segment, grow.visible))
            for r, segment, grow in zip(rows, segments, passes, strict=True)
        ]
        # The layers' own `cache` is the first segment's and they read no `parents`: the
        # attention reads each segment's K/V (SegmentsPass), the GDN layers each part.
        tree = TreePass(
            segments[0].cache, positions[:0], SegmentsPass(rows, kv, passes), cos, sin, self.rotary
        )
        tree.parts, tree.groups = parts, self._mix_groups(segments, parts)
        h, hidden = self._layers(h, tree, hidden_layers)
        for segment, (_, part) in zip(segments, parts, strict=True):
            if segment.extend:
                segment.cache.kv.advance(segment.ids.shape[0])
            else:
                segment.cache.pending = part.pending
        return split_batch(self.logits, h, hidden, segments, rows)

    @torch.no_grad()
    def forward_steps(
        self, inputs: StepInputs, hidden_layers: Sequence[int] = ()
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A batched step of one token a sequence with static shapes (`StepInputs`): logits
        [S, V] and the requested layers' outputs. K/V are stored pending (commit advances past
        them); the GDN states are committed as it runs (each cache's `pending`: `INSTALLED`)."""
        h, hidden, _ = self.forward_trees(inputs, hidden_layers)
        return self.logits(h), hidden

    @torch.no_grad()
    def forward_trees(
        self, inputs: StepInputs, hidden_layers: Sequence[int] = ()
    ) -> tuple[torch.Tensor, torch.Tensor | None, tuple]:
        """`forward_steps` of a static tree step (`inputs.trees`: S trees of W nodes, each
        row a node): the last layer's rows [S * W, hidden] (their logits: `logits`, made
        outside a captured graph so that no bucket holds its own), the requested layers'
        outputs and what each GDN layer keeps for commit (`commit_trees`); nothing committed.
        (A plain step keeps nothing.)"""
        h = self.embed_tokens(inputs.ids)
        cos, sin = self.rotary.tables(inputs.positions, h.dtype)
        tree = TreePass(None, inputs.positions[:0], inputs, cos, sin, self.rotary, steps=inputs)
        h, hidden = self._layers(h, tree, hidden_layers)
        return h, hidden, tuple(tree.pending)

    def commit_trees(self, inputs: StepInputs, kept: tuple, ends: TreeEnds) -> None:
        """After `forward_trees`: each GDN layer's states after the trees' accepted paths,
        from what it kept (`commit_trees_at`, static shapes). The K/V are the caller's
        (`commit_paths`)."""
        taps = inputs.trees.taps
        for slots, layer in zip(inputs.slots, kept, strict=True):
            commit_trees_at(layer, slots, taps, ends)

    def _segment_pass(self, segment: Segment, visible: torch.Tensor | None) -> TreePass:
        """What one segment's GDN layers read of a batched pass: its cache, tree and mode
        (`visible`: its ancestor mask, as its attention reads it; None: a chain)."""
        T, device = segment.ids.shape[0], self.embed_tokens.weight.device
        parents = segment.parents
        if parents is None:
            parents = torch.arange(-1, T - 1, device=device)
        none = torch.empty(0)
        part = TreePass(
            segment.cache, on_device(parents, device), None, none, none, self.rotary, segment.extend
        )
        if not segment.extend and T > 1 and self._factored_on(segment.cache, T):
            if visible is None:  # a chain
                visible = torch.ones(T, T, dtype=torch.bool, device=device).tril()
            part.ancestors = visible
        return part

    def _mix_groups(
        self, segments: list[Segment], parts: list[tuple[slice, TreePass]]
    ) -> list[MixGroup]:
        """The segments a batched pass's GDN layers mix together (`_mix_parts`), made once for
        them all: its one-token steps, then its trees solved factored."""
        steps = [
            i for i, (r, part) in enumerate(parts) if r.stop - r.start == 1 and not part.extend
        ]
        trees = [i for i, (_, part) in enumerate(parts) if part.ancestors is not None]
        device, groups = self.embed_tokens.weight.device, []
        for members in (steps, trees):
            if not members:
                continue
            rows = None
            if len(members) < len(parts):
                every = [np.arange(parts[i][0].start, parts[i][0].stop) for i in members]
                rows = to_device(np.concatenate(every), device)
            layout = None
            if members is trees:
                host = [segment_parents(segments[i]) for i in members]
                visible = [parts[i][1].ancestors for i in members]
                layout = trees_layout(host, visible, self.config.linear_conv_kernel_dim)
            groups.append(MixGroup(members, rows, layout))
        return groups

    def _factored_on(self, cache: HybridCache, tokens: int) -> bool:
        """Whether a `tokens`-token tree on `cache` mixes "factored" (so its GDN layers can
        share their conv, heads and solve with the other segments' of a batched pass): under
        "auto" while its factors fit, on every device (a lone round keeps its own strategy,
        on CUDA the Triton kernels its graphs replay)."""
        strategy = self.state_strategy
        if strategy == "auto" and cache.recurrent:
            state = cache.recurrent[0].recurrent
            return factored_fits(self.config.gdn_shape(), tokens, state.dtype)
        return strategy == "factored"

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return cast(self.lm_head(self.norm(h)), compute_dtype(h.dtype))  # float64 stays float64

    def _run(self, ids, cache: HybridCache, parents, hidden_layers: Sequence[int], extend: bool):
        """The last layer's output [T, hidden] (before the final norm), the requested layers'."""
        T = ids.shape[0]
        cache.kv.check_room(T)
        depth, visible = tree_layout(parents, T, ids.device)
        if parents is None:
            parents = torch.arange(-1, T - 1, device=ids.device)
        h = self.embed_tokens(ids)  # [T, hidden]
        cos, sin = self.rotary.tables(cache.length + depth, h.dtype)
        tree = TreePass(cache, parents, GrowingPass(visible), cos, sin, self.rotary, extend)
        h, hidden = self._layers(h, tree, hidden_layers)
        cache.pending = tree.pending
        return h, hidden

    def _layers(self, h: torch.Tensor, tree: TreePass, hidden_layers: Sequence[int]):
        captured = {}
        wanted = set(hidden_layers)
        for index, layer in enumerate(self.layers):
            h = layer(h, tree, self.state_strategy)
            if index in wanted:
                captured[index] = h
        hidden = torch.cat([captured[i] for i in hidden_layers], dim=-1) if hidden_layers else None
        return h, hidden

    @torch.no_grad()
    def commit(
        self,
        cache: HybridCache,
        accepted: torch.Tensor,
        pending: tuple = (),
        parents: list[int] | None = None,
    ) -> None:
        """The pending path `accepted` [K] (root first) becomes committed; the rest is dropped.

        After `forward`, what it left in the cache is committed (the path checked against the
        tree, read back from the device). After `forward_static`, pass its `pending` and the
        tree's host-side `parents` and `accepted` as a host tensor: nothing is read back.
        """
        path = accepted.tolist()
        if pending:
            states = zip(pending, cache.recurrent, strict=True)
            cache.pending = [pending_from(cache.keep, kept, state) for kept, state in states]
            if parents is not None:
                check_root_to_node_path(parents, path)
        device = self.embed_tokens.weight.device
        self._commit_paths([(cache, path)], [on_device(accepted, device)], checked=bool(pending))

    @torch.no_grad()
    def commit_batch(self, commits: list[tuple[HybridCache, list[int]]]) -> None:
        """`commit` of each (cache, accepted path) after one `forward_batch`: the GDN states of
        the trees it solved together built together (gated_deltanet `commit_many`)."""
        paths = DevicePaths([path for _, path in commits], self.embed_tokens.weight.device)
        self._commit_paths(commits, paths, checked=False)

    def _commit_paths(
        self,
        commits: list[tuple[HybridCache, list[int]]],
        on_devices: Sequence[torch.Tensor],
        checked: bool,
    ) -> None:
        """Each (cache, path) committed, `on_devices` the paths on the device: GDN states, then
        K/V."""
        for cache, path in commits:
            if len(cache.pending) != len(cache.recurrent):
                raise ValueError("commit without a forward pass to commit from")
            if not checked and cache.pending:
                check_root_to_node_path(cache.pending[0].parents.tolist(), path)
        lasts = [path[-1] for _, path in commits]
        for slot, layer in enumerate(self._layers_of(LINEAR)):
            states = [cache.recurrent[slot] for cache, _ in commits]
            kept = [cache.pending[slot] for cache, _ in commits]
            layer.linear_attn.commit_many(states, kept, on_devices, lasts)
        commit_paths([cache.kv for cache, _ in commits], [path for _, path in commits])
        for cache, _ in commits:
            cache.pending = []


def check_root_to_node_path(parents: list[int], accepted: list[int]) -> None:
    """Raise ValueError unless `accepted` runs from a root down to one node, parent to child."""
    previous = -1
    for node in accepted:
        if not 0 <= node < len(parents) or parents[node] != previous:
            raise ValueError(f"accepted {accepted} is not a root-to-node path of the pending tree")
        previous = node


def hf_text_prefix(config: dict) -> str:
    """Where the text model's tensors live in a checkpoint of this config."""
    return MULTIMODAL_TEXT_PREFIX if config.get("model_type") == "qwen3_5" else TEXT_PREFIX


def qwen3_5_checkpoint(
    path: str | Path, state_strategy: StateStrategy = "auto"
) -> tuple[Qwen3_5Model, Callable[[str], str | None]]:
    """The model of a `qwen3_5_text` or `qwen3_5` directory built on meta, and its checkpoint
    names' parameter names (None for the vision tower, `mtp.*` and a tied lm_head)."""
    hf_config = read_config(path)
    config = Qwen3_5Config.from_hf(hf_config)
    with torch.device("meta"):  # no random init of weights about to be overwritten
        model = Qwen3_5Model(config, state_strategy)
    prefix = hf_text_prefix(hf_config)

    def rename(name: str) -> str | None:
        if name == "lm_head.weight":
            return None if config.tie_word_embeddings else name
        return name[len(prefix) :] if name.startswith(prefix) else None

    return model, rename


def load_qwen3_5(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    state_strategy: StateStrategy = "auto",
) -> Qwen3_5Model:
    """Load a `qwen3_5_text` checkpoint or the text part of a `qwen3_5` (multimodal) one,
    tensor by tensor in `dtype` on `device` (the vision tower and `mtp.*` are never read)."""
    model, rename = qwen3_5_checkpoint(path, state_strategy)
    return finish_loading(model, path, rename, dtype, device)
