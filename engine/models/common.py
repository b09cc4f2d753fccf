"""Layers and loading shared by every model in the engine (dense Qwen3, hybrid Qwen3.5, DFlash).

- `RMSNorm`, `SwiGLU`, `Rotary` (RoPE with an optional partial rotary factor);
- `KVCache`: a preallocated per-layer K/V store with pending tokens and `commit`; `read` and
  `place` copy committed slots out and back; `new_kv_cache` makes it, or the same interface over
  a pool of KV blocks (engine/kv_blocks.py);
- static-shape attention (`key_window`, `WindowPass`): a pass reads a fixed window of cache
  slots whatever the committed length, which lives on the device, so one CUDA graph serves
  every length inside the window;
- HF-directory loading: `read_config`, `materialize` (meta-built module -> empty storage of
  the target dtype on the target device) and `load_checkpoint` (each tensor copied from its
  memory-mapped shard into its parameter, one at a time; unused tensors never read);
- dtype/device helpers for the command line (`resolve_dtype`, `default_device`);
- `inference_ready`: eval mode, and for float32 on the CPU each weight in the layout this CPU
  multiplies fastest, timed at load (`input_major_linears`).

Every layer works on tensors with any number of leading dimensions ([..., T, H]) so the drafter
can train on batches of blocks with the same code that decodes one sequence.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from safetensors import safe_open
from torch import nn

from engine import kernels
from engine.kernels import pass_mask, tree_attention
from engine.kernels.reference import cast
from engine.kv_blocks import (
    KVBlockPool,
    KVLayout,
    PaddedSequences,
    PagedKVCache,
    PagedSequences,
    shared_pool,
)
from engine.transfer import on_device, to_device
from engine.tree import depths_and_mask

if TYPE_CHECKING:
    from engine.models.gated_deltanet import StaticTrees

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def resolve_dtype(name: str | None, device: str) -> torch.dtype:
    """The dtype named on the command line; default bf16 on CUDA, float32 elsewhere."""
    if name is None:
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return DTYPES[name]


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


# Prompt positions whose logits one lm_head call makes when every position is scored (prompt
# logprobs): float32 logits are ~0.95 MiB a position at Qwen3.6's 248,320 tokens, so 256 rows
# are ~243 MiB (and as much again for their log-softmax), whatever the prefill chunk.
SCORE_ROWS = 256
# score(first, logits): the logits [rows, V] of a chunk's positions first..first+rows-1.
ScoreFn = Callable[[int, torch.Tensor], None]


def score_positions(states: torch.Tensor, logits: Callable, score: ScoreFn) -> None:
    """Hand `score` the logits of every row of `states` [T, H], SCORE_ROWS rows at a time."""
    for first in range(0, states.shape[0], SCORE_ROWS):
        score(first, logits(states[first : first + SCORE_ROWS]))


def undrawn_embedding(vocab: int, hidden: int) -> nn.Embedding:
    """An embedding table whose weights are left undrawn (they are loaded next): on the meta
    device nn.Embedding's own random init (`normal_`) imports torch._dynamo, 1.4 s of every
    engine start; `uniform_`, nn.Linear's, does not."""
    return nn.Embedding(vocab, hidden, _weight=torch.empty(vocab, hidden))


class RMSNorm(nn.Module):
    """y = weight * x / rms(x), normalised in float32 (float64 for float64 inputs), like HF Qwen3.

    One fused kernel on CUDA, the plain torch of `reference.rms_norm` elsewhere (engine.kernels).
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm(x, self.weight, self.eps)

    def add_then_norm(
        self, x: torch.Tensor, delta: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(x + delta), x + delta): a residual add and the next sublayer's pre-norm, fused."""
        return kernels.add_rms_norm(x, delta, self.weight, self.eps)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)), no biases; silu-multiply is one fused kernel on CUDA."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(kernels.silu_mul(self.gate_proj(x), self.up_proj(x)))


class Rotary(nn.Module):
    """Rotary position embedding (HF "rotate_half" layout) on the first `rotary_dim` of head_dim.

    `rotary_dim = head_dim * partial_rotary_factor`; the remaining dims pass through unrotated.
    `apply` is one fused kernel on CUDA.
    """

    def __init__(self, head_dim: int, theta: float, partial_rotary_factor: float = 1.0) -> None:
        super().__init__()
        self.rotary_dim = int(head_dim * partial_rotary_factor)
        self.theta = theta
        self._inverse_frequencies: dict[torch.device, torch.Tensor] = {}

    def tables(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [..., T, rotary_dim] for integer positions [..., T] (angles in float32, as HF)."""
        inv_freq = self.inverse_frequencies(positions.device)  # [R/2]
        freqs = positions.to(torch.float32)[..., None] * inv_freq  # [..., T, R/2]
        angles = torch.cat([freqs, freqs], dim=-1)  # [..., T, R]
        return cast(angles.cos(), dtype), cast(angles.sin(), dtype)

    def inverse_frequencies(self, device: torch.device) -> torch.Tensor:  # [R/2] float32
        """theta^(-2i/R), made once per device (5 ops a pass fewer), except while a CUDA graph
        is being captured: a tensor made then holds nothing until the graph replays."""
        held = self._inverse_frequencies.get(device)
        if held is not None:
            return held
        steps = torch.arange(0, self.rotary_dim, 2, device=device).float()
        inv_freq = 1.0 / (self.theta ** (steps / self.rotary_dim))
        if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            self._inverse_frequencies[device] = inv_freq
        return inv_freq

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [..., T, heads, D] rotated by tables [..., T, R] (broadcast over heads)."""
        return kernels.apply_rotary(x, cos, sin)


class QKNormProjections(nn.Module):
    """q/k/v/o projections with per-head q/k RMSNorm before RoPE: Qwen3 attention and the
    DFlash drafter's layers share them (the attention itself is the caller's kernel).

    `cfg` needs hidden_size, num_attention_heads, num_key_value_heads, head_dim, rms_norm_eps.
    """

    def __init__(self, cfg, rotary: Rotary) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        self.q_proj = nn.Linear(cfg.hidden_size, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.rotary = rotary

    def queries(self, x: torch.Tensor, rope) -> torch.Tensor:  # [..., T, Hq, D]
        q = self.q_norm(self.q_proj(x).unflatten(-1, (self.heads, self.head_dim)))
        return self.rotary.apply(q, *rope)

    def key_values(self, x: torch.Tensor, rope) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [..., T, Hkv, D] of x [..., T, H]."""
        k = self.k_norm(self.k_proj(x).unflatten(-1, (self.kv_heads, self.head_dim)))
        v = self.v_proj(x).unflatten(-1, (self.kv_heads, self.head_dim))
        return self.rotary.apply(k, *rope), v


class KVCache:
    """Preallocated keys/values [L, max_len, Hkv, D] plus `length`, the committed token count.

    A forward writes its T pending tokens at slots length .. length+T-1 without advancing
    `length`; `commit(accepted)` moves the accepted pending slots into place and advances it.
    engine/kv_blocks.py's `PagedKVCache` has the same interface over a pool of blocks; a model's
    `new_cache(max_len, blocks)` makes one over `blocks` (see `new_kv_cache`).
    """

    def __init__(
        self, layers: int, max_len: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device
    ) -> None:
        shape = (layers, max_len, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.length = 0

    @property
    def max_len(self) -> int:
        return self.k.shape[1]

    @property
    def slot_bytes(self) -> int:
        """Bytes of one token's K and V over every layer."""
        return 2 * self.k[:, :1].numel() * self.k.element_size()

    def check_room(self, pending: int) -> None:
        if self.length + pending > self.max_len:
            raise ValueError(
                f"KV cache full: {self.length} committed + {pending} pending > max_len {self.max_len}"
            )

    def store(self, layer: int, offset: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [T, Hkv, D] at slots offset.."""
        end = offset + k.shape[0]
        self.k[layer, offset:end] = k
        self.v[layer, offset:end] = v

    def write(
        self, layer: int, offset: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`store`, then the layer's K/V up to the stored slots [end, Hkv, D]."""
        self.store(layer, offset, k, v)
        end = offset + k.shape[0]
        return self.k[layer, :end], self.v[layer, :end]

    def store_at(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [T, Hkv, D] at device `slots` [T]."""
        self.k[layer].index_copy_(0, slots, k)
        self.v[layer].index_copy_(0, slots, v)

    def attend(
        self,
        layer: int,
        q: torch.Tensor,  # [T, Hq, D]
        prefix_len: int | torch.Tensor,
        visible: torch.Tensor | None,  # [T, T] bool; None = causal
        scale: float,
        keys: int,  # slots that may be read (>= prefix_len + T)
        mask: torch.Tensor | None = None,  # [T, keys] the pass's `kernels.pass_mask`
    ) -> torch.Tensor:  # [T, Hq, D]
        """Tree attention of the pending tokens' queries over the layer's first `keys` slots."""
        k, v = self.k[layer, :keys], self.v[layer, :keys]
        return tree_attention(q, k, v, prefix_len, visible, scale, mask)

    def reset(self) -> None:
        """Empty: nothing committed (a pooled cache starting its next sequence)."""
        self.length = 0

    def read(self, start: int, end: int) -> torch.Tensor:
        """A copy of slots start..end-1 of every layer: [2, L, end - start, Hkv, D] (K, V)."""
        return torch.stack([self.k[:, start:end], self.v[:, start:end]])

    def place(self, start: int, saved: torch.Tensor) -> None:
        """Write a `read` copy back at slots start.., in place (captured graphs keep reading
        the same storage); `length` is the caller's to set."""
        end = start + saved.shape[2]
        self.k[:, start:end].copy_(saved[0])
        self.v[:, start:end].copy_(saved[1])

    def advance(self, count: int) -> None:
        """The `count` pending slots after the committed ones, already in place, are committed
        (a prefill chunk: no gather needed)."""
        self.check_room(count)
        self.length += count

    def commit(self, accepted: torch.Tensor) -> None:
        """Pending slots length + accepted[i] become committed slot length + i."""
        count = accepted.shape[0]
        self.check_room(count)
        source = self.length + on_device(accepted, self.k.device)
        start, end = self.length, self.length + count
        self.k[:, start:end] = self.k[:, source]  # advanced indexing gathers a copy first
        self.v[:, start:end] = self.v[:, source]
        self.length = end


def new_kv_cache(layout: KVLayout, max_len: int, blocks: KVBlockPool | None = None):
    """A sequence's K/V for `max_len` tokens of a model of `layout`: a block table over the pool
    `blocks` (its layout must be the model's), or a contiguous `KVCache` without one."""
    if blocks is None:
        return KVCache(
            layout.layers, max_len, layout.kv_heads, layout.head_dim, layout.dtype, layout.device
        )
    if blocks.layout != layout:
        raise ValueError(f"a pool of {blocks.layout} for a model of {layout}")
    return PagedKVCache(blocks, max_len)


KEY_WINDOW_STEP = 4096


def key_window(needed: int, capacity: int) -> int:
    """The slots a static pass reads when it needs `needed`: a power of two up to
    KEY_WINDOW_STEP, then multiples of it, within the cache's `capacity`. Few distinct windows
    (few captured graphs), and at most about twice the keys needed."""
    if needed <= KEY_WINDOW_STEP:
        window = max(16, 1 << max(0, needed - 1).bit_length())
    else:
        window = -(-needed // KEY_WINDOW_STEP) * KEY_WINDOW_STEP
    return min(window, capacity)


def pass_mask_once(memo: list, q, keys: int, prefix_len, visible) -> torch.Tensor | None:
    """The attention mask of a pass (`kernels.pass_mask`, None where the kernel needs none),
    made at its first layer and kept in `memo` (the pass's, empty until then) for the others:
    every layer of a pass attends under the same mask."""
    if not memo:
        memo.append(pass_mask(q, keys, prefix_len, visible))
    return memo[0]


@dataclass
class GrowingPass:
    """Attention of a pass whose keys are exactly the committed prefix and its T tokens (a
    prefill chunk; the models' dynamic-shape forward): pending K/V written right behind."""

    visible: torch.Tensor | None  # [T, T] bool among the pending; None = causal
    mask: list = field(default_factory=list, repr=False)  # see pass_mask_once

    def attend(self, cache: KVCache, layer: int, q, k, v, scale: float) -> torch.Tensor:
        cache.store(layer, cache.length, k, v)
        keys = cache.length + k.shape[0]
        mask = pass_mask_once(self.mask, q, keys, cache.length, self.visible)
        return cache.attend(layer, q, cache.length, self.visible, scale, keys, mask)


@dataclass
class WindowPass:
    """Attention of a static-shape pass: pending K/V written at device `slots` (right after the
    device-side `length` committed), the first `keys` slots read (the rest of the window
    ignored by the kernel)."""

    slots: torch.Tensor  # [T]
    length: torch.Tensor  # [] committed slots before the pending ones
    visible: torch.Tensor  # [T, T] bool among the pending
    keys: int
    mask: list = field(default_factory=list, repr=False)  # see pass_mask_once

    def attend(self, cache: KVCache, layer: int, q, k, v, scale: float) -> torch.Tensor:
        cache.store_at(layer, self.slots, k, v)
        mask = pass_mask_once(self.mask, q, self.keys, self.length, self.visible)
        return cache.attend(layer, q, self.length, self.visible, scale, self.keys, mask)


@dataclass
class Segment:
    """One sequence's tokens in a batched pass (a target's `forward_batch`): a verify tree or
    an ar step (`parents` None: a chain) left pending for `commit`, or a prefill piece
    (`extend`) committed as it runs, whose last token alone gets logits."""

    ids: torch.Tensor  # [T]
    cache: object  # the sequence's own cache (KVCache, or the hybrid target's HybridCache)
    parents: torch.Tensor | None = None  # [T]
    extend: bool = False


def segment_parents(segment: Segment) -> np.ndarray:
    """A segment's parents on the host (a chain's when it has none)."""
    if segment.parents is None:
        return np.arange(-1, segment.ids.shape[0] - 1)
    return segment.parents.cpu().numpy()


ONE_LAUNCH_DEVICES = ("cuda",)  # where a batched pass attends every segment in one launch
# The most key slots a padded batch gathers (its K and V copies, per layer): Qwen3.6-27B's 4 KV
# heads of 256 in bf16 make that 256 MiB; longer batches attend one sequence at a time.
PADDED_KEYS = 65536


@dataclass
class SegmentsPass:
    """Attention of a batched pass: the rows of each segment attend against that segment's own
    KV cache, with its own tree mask (a `GrowingPass` each); the `cache` a layer hands
    `attend` is ignored (each segment's is used). When every cache is a block table over one
    pool: on CUDA all segments attend in one paged launch (kv_blocks.PagedSequences);
    elsewhere the segments of one token count attend together in a padded batch
    (kv_blocks.PaddedSequences: ar steps, or trees of one budget) while it pads their keys at
    most twice over, the rest one after another."""

    rows: list[slice]  # each segment's rows of the flattened pass
    caches: list[KVCache]
    passes: list[GrowingPass]
    groups: tuple[list[PaddedSequences], list[int]] | None = None  # made at the first layer:
    # the padded batches, and the segments that attend alone
    launch: PagedSequences | None = None  # one launch's layout (CUDA), made at the first layer

    def attend(self, cache, layer: int, q, k, v, scale: float) -> torch.Tensor:
        if not self._shared_pool():
            parts = zip(self.rows, self.caches, self.passes, strict=True)
            return torch.cat(
                [grow.attend(kv, layer, q[r], k[r], v[r], scale) for r, kv, grow in parts]
            )
        if q.device.type in ONE_LAUNCH_DEVICES:
            if self.launch is None:
                visible = [grow.visible for grow in self.passes]
                self.launch = PagedSequences.of(self.caches, self.rows, visible)
            return self.launch.attend(self.caches[0].pool, layer, q, k, v, scale)
        if self.groups is None:
            self.groups = self._padded_groups(q.dtype)
        batches, alone = self.groups
        if not alone and len(batches) == 1 and batches[0].covers(q.shape[0]):
            return batches[0].attend(self.caches[0].pool, layer, q, k, v, scale)
        out = torch.empty_like(q)
        for i in alone:
            r = self.rows[i]
            out[r] = self.passes[i].attend(self.caches[i], layer, q[r], k[r], v[r], scale)
        for batch in batches:
            out[batch.rows] = batch.attend(self.caches[0].pool, layer, q, k, v, scale)
        return out

    def _shared_pool(self) -> bool:
        return len(self.caches) > 1 and shared_pool(self.caches) is not None

    def _padded_groups(self, dtype: torch.dtype) -> tuple[list[PaddedSequences], list[int]]:
        """The segments grouped by token count into padded batches of two or more (each
        padding its keys at most twice over, and gathering at most PADDED_KEYS), and those
        that attend alone."""
        by_count: dict[int, list[int]] = {}
        for i, r in enumerate(self.rows):
            by_count.setdefault(r.stop - r.start, []).append(i)
        batches, alone = [], []
        for T, members in by_count.items():
            keys = [self.caches[i].length + T for i in members]
            padded = len(members) * max(keys)
            if len(members) < 2 or padded > min(2 * sum(keys), PADDED_KEYS):
                alone += members
                continue
            caches = [self.caches[i] for i in members]
            rows = [self.rows[i] for i in members]
            visible = [self.passes[i].visible for i in members]
            batches.append(PaddedSequences.of(caches, rows, visible, dtype))
        return batches, alone


@dataclass
class StepInputs:
    """A static batched step (`forward_steps`): S rows, each one sequence's bonus token alone
    at its cache's length, every value in device buffers a step fills with one copy
    (engine/step_passes.py), so the same calls serve whoever's sequences fill them. It is the
    pass's attention too: every row stores its K/V at its pool slot and attends over its own
    blocks in one paged launch (kv_blocks.PagedSequences), `layout`'s `mask` None (a row sees
    its committed keys and itself). A tree step's (`trees`, `forward_trees`) has S trees of W
    nodes, a row a node: the positions are the nodes', the mask their trees'."""

    ids: torch.Tensor  # [S] each row's token
    positions: torch.Tensor  # [S] its RoPE position: its cache's committed length
    layout: PagedSequences  # pending [S], tables [S, W], starts [S + 1], prefixes [S]
    pool: KVBlockPool  # the one the rows' block tables index
    states: torch.Tensor  # [S] each row's GDN state slot (a hybrid target's `slots`)
    slots: tuple = ()  # one gated_deltanet.StateSlots a GDN layer (none: a dense target)
    trees: StaticTrees | None = None  # a tree step's (engine/tree_passes.py): S trees of W
    # nodes, each row a node (`states` then one a tree), `layout`'s `mask` their masks

    def attend(self, cache, layer: int, q, k, v, scale: float) -> torch.Tensor:
        """Every row's attention (`cache`, the layers' own, is not read)."""
        return self.layout.attend(self.pool, layer, q, k, v, scale)


def segment_layout(
    segments: list[Segment], lengths: list[int], device
) -> tuple[list[slice], torch.Tensor, list[GrowingPass]]:
    """Each segment's rows, every row's RoPE position (its cache's `lengths` entry + its depth
    in its tree) and each segment's attention mask, for a batched pass: built on the host, the
    positions and the masks each reach the device in one copy (views of it per segment)."""
    rows, positions, masks, start = [], [], [], 0
    for segment, length in zip(segments, lengths, strict=True):
        T = segment.ids.shape[0]
        if segment.parents is None:  # a chain: causal
            depths, mask = np.arange(T), None
        else:
            depths, mask = depths_and_mask(segment.parents.cpu().numpy())
        rows.append(slice(start, start + T))
        positions.append(length + depths)
        masks.append(mask)
        start += T
    trees = [mask.reshape(-1) for mask in masks if mask is not None]
    flat = to_device(np.concatenate(trees), device) if trees else None
    passes, at = [], 0
    for mask in masks:
        visible = None
        if mask is not None:
            visible = flat[at : at + mask.size].view(mask.shape)
            at += mask.size
        passes.append(GrowingPass(visible))
    return rows, to_device(np.concatenate(positions), device), passes


def logit_rows(segments: list[Segment], rows: list[slice]) -> tuple[list[int], list[slice]]:
    """The rows of a batched pass that get logits (a prefill piece's last, every verify row)
    and each segment's share of them."""
    picked, shares = [], []
    for segment, r in zip(segments, rows, strict=True):
        wanted = [r.stop - 1] if segment.extend else list(range(r.start, r.stop))
        shares.append(slice(len(picked), len(picked) + len(wanted)))
        picked += wanted
    return picked, shares


@dataclass(frozen=True)
class BatchOutputs:
    """A batched pass's outputs: each segment's logits (its last token's for a prefill piece,
    every token's for a verify), and the requested layers' outputs of every row of the pass
    (None: none requested) with each segment's rows of them. The rows stay together so a
    step's kept ones are gathered in one call (engine/scheduler.py). A static tree step's
    verifies commit by its own pass (engine/tree_passes.py)."""

    logits: list[torch.Tensor]
    hidden: torch.Tensor | None
    rows: list[slice]
    commit: Callable[[list[tuple[Any, list[int]]]], None] | None = None  # how its verifies
    # commit, given (cache, accepted path) pairs: None, the target's `commit_batch`

    def features(self, index: int) -> torch.Tensor | None:
        """Segment `index`'s rows of `hidden` (a view)."""
        return None if self.hidden is None else self.hidden[self.rows[index]]


def split_batch(
    logits_of: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    hidden: torch.Tensor | None,
    segments: list[Segment],
    rows: list[slice],
) -> BatchOutputs:
    """A batched pass's outputs: the logits of the rows that want them (one lm_head call over
    all of them), split per segment, and the hidden rows as they are."""
    picked, shares = logit_rows(segments, rows)
    logits = logits_of(x[to_device(np.array(picked), x.device)])
    return BatchOutputs([logits[share] for share in shares], hidden, rows)


def materialize(module: nn.Module, dtype: torch.dtype, device) -> nn.Module:
    """A module built on the meta device, given uninitialised storage of `dtype` on `device`.

    Casting while still on meta costs nothing, so no float32 copy of the weights ever exists.
    Materialising unties shared parameters: re-tie them afterwards.
    """
    return module.to(dtype).to_empty(device=device)


LAYOUT_ROWS = 16  # the rows a weight layout is timed at: a verify's or a draft block's
LAYOUT_GAIN = 0.95  # the input-major layout is taken only at this share of the time or less
LAYOUT_SWEEPS = 3  # timed sweeps over a model's weights in each layout (the fastest counts)
LAYOUT_TIMED_FROM = 1 << 20  # elements (4 MiB in float32): smaller weights are input-major
_layouts: dict[tuple, bool] = {}  # (out, in, dtype, threads) -> input-major (this process)


def input_major_linears(module: nn.Module) -> nn.Module:
    """Each nn.Linear weight [out, in] laid out as this CPU multiplies it faster: row-major, or
    input-major (a transposed view of a contiguous [in, out] tensor), in place; a parameter tied
    elsewhere (an embedding) follows. Shapes, names and values stay; only strides change.

    Which layout MKL multiplies faster depends on the CPU and on whether the weight streams
    from memory (engine/NOTES.md): over the demo's weights (at most 0.5M elements) input-major
    was about twice as fast at 16 rows on one VM and is ~9% faster on an AMD EPYC VM, where it
    is ~20% slower over a 1024-wide model's (1M to 33M). So a weight under LAYOUT_TIMED_FROM
    elements is input-major, and a larger one's shape is timed, once per dtype and thread
    count in a process (`decide_layouts`): every model loaded in it lays that shape out alike.
    The values are the same either way, a product's rounding may not be: the small models of
    the demo and the tests lay out alike in every process.
    """
    undecided = [
        weight
        for weight in _linear_weights(module)
        if weight.numel() >= LAYOUT_TIMED_FROM and _layout_key(weight) not in _layouts
    ]
    if undecided:
        decide_layouts(module, undecided)
    for sub in module.modules():
        if isinstance(sub, nn.Linear):
            wanted = sub.weight.numel() < LAYOUT_TIMED_FROM or _layouts[_layout_key(sub.weight)]
            if wanted and sub.weight.is_contiguous():
                _relay(module, sub.weight, _input_major)
            elif not wanted and not sub.weight.is_contiguous():
                _relay(module, sub.weight, torch.Tensor.contiguous)
    return module


def decide_layouts(module: nn.Module, weights: list[nn.Parameter]) -> None:
    """Decide the layout of the shapes of `weights` (row-major, of `module`): every product
    x [LAYOUT_ROWS, in] times a weight timed over sweeps through them in model order, as a pass
    reads them from memory, then again with each re-laid input-major (one at a time: the
    weights and one copy in memory); a shape is input-major where its weights' time in that
    layout is at most LAYOUT_GAIN of their row-major time. `weights` ends input-major."""
    row_major = sweep_seconds(weights)
    for index, weight in enumerate(weights):
        weights[index] = _relay(module, weight, _input_major)
    input_major = sweep_seconds(weights)
    totals: dict[tuple, list[float]] = {}
    for weight, row, column in zip(weights, row_major, input_major, strict=True):
        total = totals.setdefault(_layout_key(weight), [0.0, 0.0])
        total[0], total[1] = total[0] + row, total[1] + column
    for key, (row, column) in totals.items():
        _layouts[key] = column <= LAYOUT_GAIN * row


def sweep_seconds(weights: list[torch.Tensor]) -> list[float]:
    """Each weight's fastest product x [LAYOUT_ROWS, in] times it over LAYOUT_SWEEPS sweeps
    through all of them in order, after an untimed one."""
    inputs: dict[int, torch.Tensor] = {}
    best = [float("inf")] * len(weights)
    for sweep in range(LAYOUT_SWEEPS + 1):
        for index, weight in enumerate(weights):
            x = inputs.get(weight.shape[1])
            if x is None:
                x = inputs[weight.shape[1]] = torch.ones(
                    LAYOUT_ROWS, weight.shape[1], dtype=weight.dtype, device=weight.device
                )
            started = time.perf_counter()
            torch.nn.functional.linear(x, weight)
            if sweep:
                best[index] = min(best[index], time.perf_counter() - started)
    return best


def _linear_weights(module: nn.Module) -> list[nn.Parameter]:
    """The module's nn.Linear weights in order, each once (a tied one may serve two)."""
    weights = [sub.weight for sub in module.modules() if isinstance(sub, nn.Linear)]
    return list({id(weight): weight for weight in weights}.values())


def _layout_key(weight: torch.Tensor) -> tuple:
    return (*weight.shape, weight.dtype, torch.get_num_threads())


def _input_major(weight: torch.Tensor) -> torch.Tensor:
    return weight.t().contiguous().t()


def _relay(module: nn.Module, weight: nn.Parameter, laid: Callable) -> nn.Parameter:
    """`weight` replaced by `laid(weight)` wherever `module` holds it (a tie follows)."""
    new = nn.Parameter(laid(weight.detach()), requires_grad=weight.requires_grad)
    for sub in module.modules():
        for name, param in list(sub.named_parameters(recurse=False)):
            if param is weight:
                setattr(sub, name, new)
    return new


def inference_ready(model: nn.Module) -> nn.Module:
    """A loaded model in eval mode; float32 on the CPU gets each linear weight in the layout it
    multiplies fastest (`input_major_linears`; the input-major layout gained nothing for float64
    and lost ~15% for bfloat16 at 16 rows, so those stay row-major)."""
    weight = next(model.parameters())
    if weight.device.type == "cpu" and weight.dtype == torch.float32:
        input_major_linears(model)
    return model.eval()


def read_config(model_dir: str | Path) -> dict:
    return json.loads((Path(model_dir) / "config.json").read_text())


def rope_theta(config: dict, default: float = 10000.0) -> float:
    """rope_theta from the top level (older configs) or from rope_parameters (transformers 5)."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ValueError(
            f"unsupported rope_type {rope_type!r} (only 'default' RoPE is implemented)"
        )
    return float(params.get("rope_theta", config.get("rope_theta", default)))


def checkpoint_files(model_dir: str | Path) -> dict[str, Path]:
    """Where each tensor of an HF directory lives: the shards its index names, else every
    *.safetensors file (their headers only are read)."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / file for name, file in weight_map.items()}
    files: dict[str, Path] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            files |= dict.fromkeys(f.keys(), file)
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors weights")
    return files


Rename = Callable[[str], "str | tuple[str, ...] | None"]
Select = Callable[[str], "tuple[int, torch.Tensor] | None"]


def load_checkpoint(
    module: nn.Module, model_dir: str | Path, rename: Rename, select: Select | None = None
) -> None:
    """Copy every checkpoint tensor that `rename` maps to a parameter name into that parameter.

    `rename(tensor_name)` gives the parameter's name (or several: a tied head shard), or None
    for a tensor the model does not use (a vision tower, `mtp.*`, a tied lm_head): those are
    never read. `select(parameter_name)`, when given, may say that the parameter holds only
    some rows (dim 0) or columns (dim 1) of its tensor, as (dim, indices): only those are read
    (a tensor-parallel rank's share). Each tensor is read from its memory-mapped shard and
    copied (cast to the parameter's dtype, moved to its device) on its own, so beyond the model
    at most one tensor is resident. A parameter without a tensor, or a tensor without a
    parameter, is an error.
    """
    params = dict(module.named_parameters())
    sources: dict[Path, dict[str, tuple[str, ...]]] = {}  # shard -> {tensor: parameter names}
    for tensor_name, file in checkpoint_files(model_dir).items():
        if (names := rename(tensor_name)) is not None:
            names = (names,) if isinstance(names, str) else names
            sources.setdefault(file, {})[tensor_name] = names
    named = {name for shard in sources.values() for names in shard.values() for name in names}
    missing, unexpected = sorted(set(params) - named), sorted(named - set(params))
    if missing or unexpected:
        raise ValueError(
            f"weights do not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    with torch.no_grad():
        for file, tensors in sources.items():
            for tensor_name, names in tensors.items():
                for name in names:
                    part = select(name) if select else None
                    # One mapping per tensor: a shard kept open would keep every page it had
                    # read resident (they count as this process's memory) until it closed.
                    with safe_open(str(file), "pt") as shard:
                        if part is None:
                            value = shard.get_tensor(tensor_name)
                        else:
                            value = read_part(shard.get_slice(tensor_name), *part)
                        params[name].copy_(value)


def read_part(piece, dim: int, indices: torch.Tensor) -> torch.Tensor:
    """Rows (dim 0) or columns (dim 1) `indices` of a safetensors slice, read run by run."""
    runs, start = [], 0
    values = indices.tolist()
    for i in range(1, len(values) + 1):
        if i == len(values) or values[i] != values[i - 1] + 1:
            runs.append((values[start], values[i - 1] + 1))
            start = i
    parts = [piece[a:b] if dim == 0 else piece[:, a:b] for a, b in runs]
    return torch.cat(parts, dim=dim)


def finish_loading(
    model: nn.Module,
    model_dir: str | Path,
    rename: Rename,
    dtype: torch.dtype,
    device,
    select: Select | None = None,
) -> nn.Module:
    """A model built on meta, materialised in `dtype` on `device`, its ties restored (they come
    undone), its weights read from `model_dir`, ready for inference."""
    model = materialize(model, dtype, device)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    load_checkpoint(model, model_dir, rename, select)
    return inference_ready(model)
