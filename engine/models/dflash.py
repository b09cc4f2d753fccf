"""The DFlash block drafter (z-lab checkpoint layout), for inference and for training.

The drafter has no embedding and no lm_head: it borrows the target's. Context features are the
target's hidden states after `target_layer_ids`, concatenated, then `fc` and `hidden_norm`.
Each layer: pre-norm attention whose queries come from the block stream only and whose keys and
values come from [context ; block] (per-head q/k RMSNorm before RoPE, non-causal inside the
block), then a pre-norm SwiGLU MLP. A block is [bonus, mask x (B-1)] at the positions right
after the context; one pass gives logits for the B-1 mask positions.

Inference: `drafter.draft(target, cache, context, bonus)` keeps the context K/V in a
preallocated cache across rounds and discards the block part every round;
`drafter.draft_static(target, cache, inputs, keys)` is the same with static shapes for CUDA
graphs (engine/decode.py): the context padded to a fixed width, its length, the cache length
and the bonus on the device, attention over a fixed window of `keys` cache slots.
Training: `drafter.block_logits(target, context, block_ids, block_starts)` is differentiable
and runs many blocks per sequence (and any leading batch dims) with an explicit mask: the same
layer code as `draft`.

Layer types (newer checkpoints): a "sliding_attention" layer is causal inside the block and
each query sees keys within `sliding_window` positions; `is_causal` in the config overrides the
causality of every layer. Optional scalars: `input_embedding_scale` (block embeddings),
`output_multiplier` and `final_logit_softcapping` (draft logits). DFlash2 checkpoints (dynamic
convolutions, candidate selector) are refused.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np
import torch
from torch import nn

from engine.kernels.reference import cast, compute_dtype
from engine.kv_blocks import KVBlockPool, KVLayout, shared_pool
from engine.models.common import (
    GrowingPass,
    KVCache,
    QKNormProjections,
    RMSNorm,
    Rotary,
    SegmentsPass,
    SwiGLU,
    WindowPass,
    finish_loading,
    new_kv_cache,
    read_config,
    rope_theta,
)
from engine.transfer import to_device

CONTEXT_PIECE = 2048  # context tokens projected at once: bounds the first draft after a prefill


@dataclass
class DFlashConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    is_causal: bool | None = None
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None

    @classmethod
    def from_dict(cls, raw: dict) -> DFlashConfig:
        """Both z-lab layouts: block_size / rope_theta top-level or in dflash_config / rope_parameters."""
        merged = {"block_size": 16, **raw, **raw.get("dflash_config", {})}
        if "conv_kernel_size" in merged or "selector_rank" in merged:
            raise ValueError(
                "DFlash2 drafters (convolutions, candidate selector) are not supported"
            )
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in merged.items() if k in known}
        values.setdefault("head_dim", raw["hidden_size"] // raw["num_attention_heads"])
        values["rope_theta"] = rope_theta(raw, cls.rope_theta)
        values["target_layer_ids"] = tuple(values["target_layer_ids"])
        values["layer_types"] = tuple(raw.get("layer_types") or ())
        return cls(**values)

    def attention_kind(self, layer: int) -> tuple[bool, int | None]:
        """(causal inside the block, sliding window or None) of `layer`."""
        sliding = bool(self.layer_types) and self.layer_types[layer] == "sliding_attention"
        causal = sliding if self.is_causal is None else bool(self.is_causal)
        return causal, (self.sliding_window if sliding else None)


@dataclass
class DraftInputs:
    """What `draft_static` reads, all on the device."""

    context: torch.Tensor  # [W, n*H] target features; the first `count` rows are real
    length: torch.Tensor  # [] committed context tokens in the cache
    count: torch.Tensor  # [] real context rows
    bonus: torch.Tensor  # [] the block's first token


@dataclass(frozen=True)
class DraftSteps:
    """What `draft_steps` reads, all in device buffers (engine/draft_passes.py): S sequences'
    contexts padded to C rows each and their blocks of B."""

    context: torch.Tensor  # [S * C, n*H] target features; a sequence's first rows are real
    context_positions: torch.Tensor  # [S * C] each row's RoPE position
    context_slots: torch.Tensor  # [S * C] the pool slots their K/V are stored at
    ids: torch.Tensor  # [S * B] each block: its bonus, then mask tokens
    positions: torch.Tensor  # [S * B] the block's RoPE positions, right after its context
    pool: KVBlockPool  # the one the sequences' block tables index
    layouts: dict  # causal -> kv_blocks.PagedSequences of the blocks (pending at their slots)


class DraftLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig, rotary: Rotary) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = QKNormProjections(cfg, rotary)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def block_qkv(self, x: torch.Tensor, rope):
        """Queries and keys/values of the block stream x [..., T, H]."""
        h = self.input_layernorm(x)
        return (self.self_attn.queries(h, rope), *self.self_attn.key_values(h, rope))

    def context_and_block_qkv(self, ctx: torch.Tensor, x: torch.Tensor, rope, block_rope):
        """The block's queries [B, Hq, D], and keys/values [C + B, Hkv, D] of the context
        features ctx [C, H] then the block stream x [B, H]: each projected on its own, normed
        and rotated together (`rope` covers both, `block_rope` the block's rows): per row what
        `key_values` and `block_qkv` give, in one norm and one RoPE call instead of two."""
        attn, h = self.self_attn, self.input_layernorm(x)
        shape = (attn.kv_heads, attn.head_dim)
        k = torch.cat([attn.k_proj(ctx), attn.k_proj(h)]).unflatten(-1, shape)
        v = torch.cat([attn.v_proj(ctx), attn.v_proj(h)]).unflatten(-1, shape)
        return attn.queries(h, block_rope), attn.rotary.apply(attn.k_norm(k), *rope), v

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Residual after attention output attn [..., T, Hq, D], then the MLP block."""
        x = x + self.self_attn.o_proj(attn.flatten(-2))
        return x + self.mlp(self.post_attention_layernorm(x))


def scaled(x: torch.Tensor, factor: float) -> torch.Tensor:
    """x * factor, x itself for a factor of 1 (the same values, one op fewer: most checkpoints
    scale neither their embeddings nor their logits)."""
    return x if factor == 1.0 else x * factor


def masked_attention(
    q: torch.Tensor,  # [..., T, Hq, D]
    k: torch.Tensor,  # [..., S, Hkv, D]
    v: torch.Tensor,  # [..., S, Hkv, D]
    visible: torch.Tensor,  # [..., T, S] bool
    scale: float,
) -> torch.Tensor:  # [..., T, Hq, D]
    """Differentiable grouped-query attention under an explicit mask (training path)."""
    group = q.shape[-2] // k.shape[-2]
    k, v = k.repeat_interleave(group, dim=-2), v.repeat_interleave(group, dim=-2)
    work = compute_dtype(q.dtype)
    scores = torch.einsum("...thd,...shd->...hts", q.to(work), k.to(work)) * scale
    scores = scores.masked_fill(~visible.unsqueeze(-3), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("...hts,...shd->...thd", probs, v.to(work)).to(q.dtype)


def restrict(
    visible: torch.Tensor,  # [..., T, S] bool
    query_pos: torch.Tensor,  # [..., T]
    key_pos: torch.Tensor,  # [..., S]
    causal: bool,
    window: int | None,
) -> torch.Tensor:
    """`visible` narrowed to causal keys and/or keys within `window` positions of each query."""
    q, k = query_pos[..., :, None], key_pos[..., None, :]
    if causal:
        visible = visible & (k <= q)
    if window is not None:
        visible = visible & (q - k < window)
        if not causal:
            visible = visible & (k - q < window)
    return visible


class DFlashDrafter(nn.Module):
    """Parameter names are the z-lab checkpoint's (no prefix)."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.config = cfg
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta)
        n_features = len(cfg.target_layer_ids) * cfg.hidden_size
        self.fc = nn.Linear(n_features, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(
            DraftLayer(cfg, self.rotary) for _ in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

    @property
    def target_layer_ids(self) -> tuple[int, ...]:
        return self.config.target_layer_ids

    def kv_layout(self) -> KVLayout:
        """The K/V geometry of every layer (a KV block pool's, engine/kv_blocks.py)."""
        cfg, weight = self.config, self.fc.weight
        return KVLayout(
            cfg.num_hidden_layers,
            cfg.num_key_value_heads,
            cfg.head_dim,
            weight.dtype,
            weight.device,
        )

    def new_cache(self, max_len: int, blocks: KVBlockPool | None = None) -> KVCache:
        """Context K/V for up to max_len committed tokens, plus room for one block: a block
        table over `blocks`, else contiguous."""
        return new_kv_cache(self.kv_layout(), max_len + self.config.block_size, blocks)

    def _positions_rope(self, positions: torch.Tensor):
        return self.rotary.tables(positions, self.fc.weight.dtype)

    @torch.no_grad()
    def draft(
        self,
        target: nn.Module,
        cache: KVCache,
        context: torch.Tensor,  # [N, n*H] target features of tokens committed since last call
        bonus: int,
    ) -> torch.Tensor:  # [B-1, V] float32
        """Append the context to the cache, run [bonus, mask x (B-1)] after it, return its logits."""
        B, N, device = self.block_size, context.shape[0], self.fc.weight.device
        cache.check_room(N + B)
        start = cache.length + N  # the bonus token's position
        self._write_context(cache, context)  # a whole prompt's, after a prefill
        block_pos = torch.arange(start, start + B, device=device)
        block_rope = self._positions_rope(block_pos)
        ids = torch.full((B,), self.mask_token_id, dtype=torch.long, device=device)
        ids[0] = bonus
        x = self._embed(target, ids)  # [B, H]
        for index, layer in enumerate(self.layers):
            q, k, v = layer.block_qkv(x, block_rope)
            causal, window = self.config.attention_kind(index)
            if window is None:  # the fast kernel: whole context visible
                cache.store(index, start, k, v)
                in_block = torch.ones(B, B, dtype=torch.bool, device=device)
                in_block = in_block.tril() if causal else in_block
                attn = cache.attend(index, q, start, in_block, self._scale, start + B)
            else:  # keys before `first` are out of every query's window
                keys, values = cache.write(index, start, k, v)  # [start + B, Hkv, D]
                first = max(0, start - window + 1)
                key_pos = torch.arange(first, start + B, device=device)
                visible = torch.ones(B, len(key_pos), dtype=torch.bool, device=device)
                visible = restrict(visible, block_pos, key_pos, causal, window)
                attn = masked_attention(q, keys[first:], values[first:], visible, self._scale)
            x = layer.finish(x, attn)
        cache.length = start
        return self.logits(target, x[1:])

    @torch.no_grad()
    def draft_batch(
        self, target: nn.Module, items: list[tuple[KVCache, torch.Tensor, int]]
    ) -> torch.Tensor:  # [n, B-1, V] float32
        """`draft` of several sequences in one pass: each (cache, context [N, n*H], bonus) has
        its context appended to its own cache and its block attend to it; the context
        projections, the blocks' layers and the lm_head run over every sequence's rows at once,
        and so does attention where the caches share one block pool (`SegmentsPass`: one paged
        launch on CUDA, padded batches elsewhere). A drafter with sliding-window layers drafts
        them one after another."""
        if not self.static_ok:
            return torch.stack(
                [self.draft(target, cache, context, bonus) for cache, context, bonus in items]
            )
        B, device = self.block_size, self.fc.weight.device
        for cache, context, _ in items:
            cache.check_room(context.shape[0] + B)
        self._write_contexts([(cache, context) for cache, context, _ in items])
        caches = [cache for cache, _, _ in items]
        for cache, context, _ in items:
            cache.length += context.shape[0]  # the context is committed; the block is not
        block_pos = torch.cat([torch.arange(c.length, c.length + B, device=device) for c in caches])
        rope = self._positions_rope(block_pos)
        ids = torch.full((len(items), B), self.mask_token_id, dtype=torch.long, device=device)
        ids[:, 0] = to_device(np.array([bonus for _, _, bonus in items]), device)
        x = self._embed(target, ids.flatten())  # [n*B, H]
        rows = [slice(row * B, (row + 1) * B) for row in range(len(items))]
        in_block = torch.ones(B, B, dtype=torch.bool, device=device)
        passes = {  # by causal: each block attends its context and (part of) itself
            causal: SegmentsPass(rows, caches, [GrowingPass(mask) for _ in caches])
            for causal, mask in ((True, in_block.tril()), (False, in_block))
        }
        for index, layer in enumerate(self.layers):
            q, k, v = layer.block_qkv(x, rope)
            block = passes[self.config.attention_kind(index)[0]]
            x = layer.finish(x, block.attend(None, index, q, k, v, self._scale))
        drafted = x.unflatten(0, (len(items), B))[:, 1:]  # every block but its bonus
        return self.logits(target, drafted)

    @torch.no_grad()
    def draft_steps(self, target: nn.Module, inputs: DraftSteps) -> torch.Tensor:
        """`draft_batch` with static shapes (a CUDA graph a bucket: engine/draft_passes.py):
        every context's K/V stored at its slots, every block attending its own sequence's keys
        in one paged launch a layer. Returns the blocks' last rows [S, B-1, H] but their
        bonuses' (their logits: `logits`, made outside a captured graph so that no bucket
        holds its own); the caller advances each cache's length past its context."""
        ctx = self.hidden_norm(self.fc(inputs.context.to(self.fc.weight.dtype)))
        context_rope = self._positions_rope(inputs.context_positions)
        rope = self._positions_rope(inputs.positions)
        x = self._embed(target, inputs.ids)  # [S * B, H]
        for index, layer in enumerate(self.layers):
            inputs.pool.store(
                index, inputs.context_slots, *layer.self_attn.key_values(ctx, context_rope)
            )
            q, k, v = layer.block_qkv(x, rope)
            block = inputs.layouts[self.config.attention_kind(index)[0]]
            x = layer.finish(x, block.attend(inputs.pool, index, q, k, v, self._scale))
        return x.unflatten(0, (-1, self.block_size))[:, 1:]  # every block but its bonus

    def _write_contexts(self, items: list[tuple[KVCache, torch.Tensor]]) -> None:
        """Every sequence's context K/V behind its cache's tokens: a round's few rows of all
        of them projected at once (and stored at once where their caches share a block pool),
        a long one (a prompt's, after its prefill) on its own."""
        short = [(cache, context) for cache, context in items if context.shape[0] <= CONTEXT_PIECE]
        for cache, context in items:
            if context.shape[0] > CONTEXT_PIECE:
                self._write_context(cache, context)
        if not short:
            return
        device = self.fc.weight.device
        positions = torch.cat(
            [torch.arange(c.length, c.length + x.shape[0], device=device) for c, x in short]
        )
        contexts = torch.cat([context for _, context in short])
        ctx = self.hidden_norm(self.fc(contexts.to(self.fc.weight.dtype)))
        rope = self._positions_rope(positions)
        bounds = [0, *itertools.accumulate(x.shape[0] for _, x in short)]
        pool = shared_pool([cache for cache, _ in short])
        if pool is not None:
            slots = torch.cat([c.physical(c.length, c.length + x.shape[0]) for c, x in short])
        for index, layer in enumerate(self.layers):
            k, v = layer.self_attn.key_values(ctx, rope)
            if pool is not None:
                pool.store(index, slots, k, v)
                continue
            for (cache, _), first, end in zip(short, bounds, bounds[1:], strict=False):
                cache.store(index, cache.length, k[first:end], v[first:end])

    @property
    def static_ok(self) -> bool:
        """Whether `draft_static` applies: no sliding-window layers."""
        kinds = (self.config.attention_kind(i) for i in range(self.config.num_hidden_layers))
        return all(window is None for _, window in kinds)

    @torch.no_grad()
    def draft_static(
        self, target: nn.Module, cache: KVCache, inputs: DraftInputs, keys: int
    ) -> torch.Tensor:  # [B-1, V] float32
        """`draft` with static shapes: the padded context is written at slots length.., the
        block right after its real rows (over the padding), and attention reads `keys` slots.
        The caller advances cache.length by the count afterwards."""
        B, W, device = self.block_size, inputs.context.shape[0], self.fc.weight.device
        context_slots = inputs.length + torch.arange(W, device=device)
        start = inputs.length + inputs.count  # the bonus token's position
        block_slots = start + torch.arange(B, device=device)
        ctx = self.hidden_norm(self.fc(inputs.context.to(self.fc.weight.dtype)))  # [W, H]
        cos, sin = self._positions_rope(torch.cat([context_slots, block_slots]))  # [W + B, R]
        rope = (cos, sin), (cos[W:], sin[W:])  # the context's and the block's, the block's
        first = torch.arange(B, device=device) == 0
        x = self._embed(target, torch.where(first, inputs.bonus, self.mask_token_id))  # [B, H]
        in_block = torch.ones(B, B, dtype=torch.bool, device=device)
        passes = {
            causal: WindowPass(block_slots, start, in_block.tril() if causal else in_block, keys)
            for causal in {self.config.attention_kind(i)[0] for i in range(len(self.layers))}
        }
        for index, layer in enumerate(self.layers):
            q, k, v = layer.context_and_block_qkv(ctx, x, *rope)
            cache.store_at(index, context_slots, k[:W], v[:W])  # before the block's: padding
            block = passes[self.config.attention_kind(index)[0]]  # rows may share its slots
            x = layer.finish(x, block.attend(cache, index, q, k[W:], v[W:], self._scale))
        return self.logits(target, x[1:])

    @torch.no_grad()
    def append_context(self, cache: KVCache, context: torch.Tensor) -> None:
        """Commit the K/V of context features [N, n*H] after the cache's tokens without drafting
        (a finished sequence's last features, so its cache covers every committed token)."""
        cache.check_room(context.shape[0])
        self._write_context(cache, context)
        cache.length += context.shape[0]

    def _write_context(self, cache: KVCache, context: torch.Tensor) -> None:
        """The K/V of context features [N, n*H] at slots cache.length.., CONTEXT_PIECE at once."""
        for offset in range(0, context.shape[0], CONTEXT_PIECE):
            self._write_piece(cache, context[offset : offset + CONTEXT_PIECE], offset)

    def _write_piece(self, cache: KVCache, context: torch.Tensor, offset: int) -> None:
        """Every layer's K/V of context features [n, n*H] at slots cache.length + offset .."""
        first = cache.length + offset
        positions = torch.arange(first, first + context.shape[0], device=self.fc.weight.device)
        ctx = self.hidden_norm(self.fc(context.to(self.fc.weight.dtype)))  # [n, H]
        rope = self._positions_rope(positions)
        for index, layer in enumerate(self.layers):
            cache.store(index, first, *layer.self_attn.key_values(ctx, rope))

    def _embed(self, target: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return scaled(target.embed_tokens(ids), self.config.input_embedding_scale)

    def logits(self, target: nn.Module, x: torch.Tensor) -> torch.Tensor:  # float32
        logits = cast(target.lm_head(self.norm(x)), torch.float32)
        logits = scaled(logits, self.config.output_multiplier)
        if cap := self.config.final_logit_softcapping:
            logits = torch.tanh(logits / cap) * cap
        return logits

    @property
    def _scale(self) -> float:
        return self.config.head_dim**-0.5

    def block_logits(
        self,
        target: nn.Module,
        context: torch.Tensor,  # [..., C, n*H] target features of sequence tokens 0..C-1
        block_ids: torch.Tensor,  # [..., nb, B] each block: [bonus token, mask x (B-1)]
        block_starts: torch.Tensor,  # [..., nb] position of each block's bonus token (<= C)
    ) -> torch.Tensor:  # [..., nb, B-1, V] float32
        """Differentiable draft logits of many blocks at once (training).

        Block b sits at positions block_starts[b] .. + B-1, sees the context tokens before its
        bonus (position < block_starts[b]) and its own B tokens, exactly as `draft` would.
        """
        nb, B, C = block_ids.shape[-2], block_ids.shape[-1], context.shape[-2]
        device = context.device
        ctx = self.hidden_norm(self.fc(context.to(self.fc.weight.dtype)))  # [..., C, H]
        ctx_pos = torch.arange(C, device=device)
        block_pos = block_starts[..., None] + torch.arange(B, device=device)  # [..., nb, B]
        ctx_rope = self._positions_rope(ctx_pos)
        block_rope = self._positions_rope(block_pos.flatten(-2))
        row_block = torch.arange(nb, device=device).repeat_interleave(B)  # [nb*B]
        same_block = row_block[:, None] == row_block[None, :]  # [nb*B, nb*B]
        row_start = block_starts.repeat_interleave(B, dim=-1)[..., None]  # [..., nb*B, 1]
        sees_ctx = ctx_pos < row_start  # [..., nb*B, C]: the context before the row's block
        base = torch.cat([sees_ctx, same_block.expand(*sees_ctx.shape[:-1], -1)], dim=-1)
        x = self._embed(target, block_ids).flatten(-3, -2)  # [..., nb*B, H]
        flat_pos = block_pos.flatten(-2)  # [..., nb*B]
        key_pos = torch.cat([ctx_pos.expand(*flat_pos.shape[:-1], -1), flat_pos], dim=-1)
        for index, layer in enumerate(self.layers):
            visible = restrict(base, flat_pos, key_pos, *self.config.attention_kind(index))
            k_ctx, v_ctx = layer.self_attn.key_values(ctx, ctx_rope)
            q, k, v = layer.block_qkv(x, block_rope)
            attn = masked_attention(
                q,
                torch.cat([k_ctx, k], dim=-3),
                torch.cat([v_ctx, v], dim=-3),
                visible,
                self._scale,
            )
            x = layer.finish(x, attn)
        logits = self.logits(target, x)  # [..., nb*B, V]
        return logits.unflatten(-2, (nb, B))[..., 1:, :]


def load_dflash(
    model_dir: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> DFlashDrafter:
    """A DFlash drafter from a z-lab-layout directory (config.json + safetensors)."""
    cfg = DFlashConfig.from_dict(read_config(model_dir))
    with torch.device("meta"):
        drafter = DFlashDrafter(cfg)
    return finish_loading(drafter, model_dir, lambda name: name, dtype, device)
