"""Dense Qwen3 target model: our own compact implementation, loaded from an HF directory.

Architecture: token embedding, L x [RMSNorm -> GQA attention (per-head q/k RMSNorm, RoPE)
-> residual, RMSNorm -> SwiGLU -> residual], final RMSNorm, lm_head (tied or not).

Interface shared by every target model (see engine/decode.py):
- `new_cache(max_len)`; `forward(ids [T], cache, parents [T] | None, hidden_layers)` runs T
  pending tokens after the committed prefix (a chain when parents is None, else a tree: token
  i sees the prefix, its ancestors and itself, at RoPE position cache.length + depth(i)) and
  returns (float32 logits [T, V] (float64 for float64 models), concatenated outputs of the
  requested layers [T, n*H] | None;
  layer L's output is HF's hidden_states[L + 1], so the last layer's is taken after the final norm);
- `commit(cache, accepted [K])` keeps the accepted root-to-node path and drops the rest;
- `extend(ids [T], cache, hidden_layers)` runs a chain and commits all of it at once (a prefill
  chunk): logits [1, V] of its last token only, the requested layers' outputs of every token;
- `forward_static(inputs, cache, keys, hidden_layers)`: `forward` with static shapes, for CUDA
  graphs (engine/decode.py): everything it reads is on the device (engine/tree.py TreeInputs)
  and attention reads a fixed window of `keys` cache slots; returns (logits, hidden, pending),
  pending being what `commit(cache, accepted, pending)` needs beyond the cache (none here).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path

import torch
from torch import nn

from engine.kernels.reference import cast, compute_dtype
from engine.kv_blocks import KVBlockPool, KVLayout, commit_paths
from engine.models.common import (
    BatchOutputs,
    GrowingPass,
    KVCache,
    QKNormProjections,
    RMSNorm,
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
    split_batch,
    undrawn_embedding,
)
from engine.tree import TreeInputs, tree_layout


@dataclass
class Qwen3Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768

    @classmethod
    def from_dict(cls, raw: dict) -> Qwen3Config:
        for unsupported in ("attention_bias", "use_sliding_window"):
            if raw.get(unsupported):
                raise ValueError(f"Qwen3 with {unsupported}=true is not supported")
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in raw.items() if k in known}
        values.setdefault("head_dim", raw["hidden_size"] // raw["num_attention_heads"])
        values["rope_theta"] = rope_theta(raw, cls.rope_theta)
        return cls(**values)


class Attention(QKNormProjections):
    """Grouped-query attention with per-head q/k RMSNorm before RoPE."""

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin [T, R]
        cache: KVCache,
        layer: int,
        attention: GrowingPass | WindowPass,
    ) -> torch.Tensor:  # [T, H]
        q = self.queries(x, rope)  # [T, Hq, D]
        k, v = self.key_values(x, rope)  # [T, Hkv, D]
        out = attention.attend(cache, layer, q, k, v, self.head_dim**-0.5)
        return self.o_proj(out.flatten(-2))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen3Config, rotary: Rotary) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, rotary)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, rope, cache, layer, attention) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, cache, layer, attention)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3Model(nn.Module):
    """The dense target. Parameter names follow HF's without the `model.` prefix."""

    def __init__(self, cfg: Qwen3Config) -> None:
        super().__init__()
        self.config = cfg
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta)
        self.embed_tokens = undrawn_embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, self.rotary) for _ in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings and isinstance(self.lm_head, nn.Linear):
            self.lm_head.weight = (
                self.embed_tokens.weight
            )  # (a tensor-parallel shard may have none)

    def kv_layout(self) -> KVLayout:
        """The K/V geometry of every layer (a KV block pool's, engine/kv_blocks.py)."""
        weight, cfg = self.embed_tokens.weight, self.config
        return KVLayout(
            cfg.num_hidden_layers,
            cfg.num_key_value_heads,
            cfg.head_dim,
            weight.dtype,
            weight.device,
        )

    def new_cache(self, max_len: int, blocks: KVBlockPool | None = None) -> KVCache:
        """K/V for max_len tokens: a block table over `blocks`, else contiguous."""
        return new_kv_cache(self.kv_layout(), max_len, blocks)

    @torch.no_grad()
    def forward(
        self,
        ids: torch.Tensor,  # [T] int64
        cache: KVCache,
        parents: torch.Tensor | None = None,  # [T] int64, None = chain
        hidden_layers: Sequence[int] = (),
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # logits [T, V], hidden [T, n*H]
        x, hidden = self._run(ids, cache, parents, hidden_layers)
        return self.logits(x), hidden

    @torch.no_grad()
    def extend(
        self,
        ids: torch.Tensor,
        cache: KVCache,
        hidden_layers: Sequence[int] = (),
        score: ScoreFn | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # logits [1, V], hidden [T, n*H]
        """Run the chain `ids` (a prefill chunk) and commit all of it; logits of its last token
        (`score`: also every position's, a slice at a time, see `score_positions`)."""
        x, hidden = self._run(ids, cache, None, hidden_layers)
        cache.advance(ids.shape[0])
        if score is not None:
            score_positions(x, self.logits, score)
        return self.logits(x[-1:]), hidden

    @torch.no_grad()
    def forward_static(
        self, inputs: TreeInputs, cache: KVCache, keys: int, hidden_layers: Sequence[int] = ()
    ) -> tuple[torch.Tensor, torch.Tensor | None, tuple]:  # logits [T, V], hidden, pending
        """`forward` of inputs.ids at device length inputs.length, reading `keys` cache slots."""
        rope = self.rotary.tables(inputs.length + inputs.depths, self.embed_tokens.weight.dtype)
        attention = WindowPass(inputs.slots(), inputs.length, inputs.visible, keys)
        x, hidden = self._layers(inputs.ids, rope, cache, attention, hidden_layers)
        return self.logits(x), hidden, ()

    @torch.no_grad()
    def forward_batch(
        self, segments: list[Segment], hidden_layers: Sequence[int] = ()
    ) -> BatchOutputs:
        """Several sequences' `forward` (or `extend`, a prefill piece) in one pass: their tokens
        flattened through the embeddings, projections, MLPs and lm_head, each segment's
        attention against its own cache. Per segment: logits (its last token's for a prefill
        piece, committed; every token's for a verify, left pending); the pass's hidden rows."""
        for segment in segments:
            segment.cache.check_room(segment.ids.shape[0])
        lengths = [segment.cache.length for segment in segments]
        rows, positions, passes = segment_layout(segments, lengths, self.embed_tokens.weight.device)
        rope = self.rotary.tables(positions, self.embed_tokens.weight.dtype)
        attention = SegmentsPass(rows, [segment.cache for segment in segments], passes)
        ids = torch.cat([segment.ids for segment in segments])
        x, hidden = self._layers(ids, rope, None, attention, hidden_layers)
        for segment in segments:
            if segment.extend:
                segment.cache.advance(segment.ids.shape[0])
        return split_batch(self.logits, x, hidden, segments, rows)

    @torch.no_grad()
    def forward_steps(
        self, inputs: StepInputs, hidden_layers: Sequence[int] = ()
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # logits [S, V], hidden
        """A batched step of one token a sequence with static shapes (`StepInputs`): each row's
        K/V stored in its own blocks (pending: commit advances past it) and its logits."""
        x, hidden, _ = self.forward_trees(inputs, hidden_layers)
        return self.logits(x), hidden

    @torch.no_grad()
    def forward_trees(
        self, inputs: StepInputs, hidden_layers: Sequence[int] = ()
    ) -> tuple[torch.Tensor, torch.Tensor | None, tuple]:  # rows [S * W, H], hidden, kept
        """`forward_steps` of a static tree step (`inputs.trees`, a row a node: the trees'
        masks in its layout) up to the final norm (their logits: `logits`, made outside a
        captured graph); a dense pass keeps nothing else for commit."""
        rope = self.rotary.tables(inputs.positions, self.embed_tokens.weight.dtype)
        x, hidden = self._layers(inputs.ids, rope, None, inputs, hidden_layers)
        return x, hidden, ()

    def logits(self, x: torch.Tensor) -> torch.Tensor:  # float32; float64 stays float64
        return cast(self.lm_head(x), compute_dtype(x.dtype))

    def _run(self, ids, cache: KVCache, parents, hidden_layers: Sequence[int]):
        """The final-normed hidden states [T, H] and the requested layers' outputs."""
        T = ids.shape[0]
        cache.check_room(T)
        depths, visible = tree_layout(parents, T, ids.device)
        rope = self.rotary.tables(cache.length + depths, self.embed_tokens.weight.dtype)
        return self._layers(ids, rope, cache, GrowingPass(visible), hidden_layers)

    def _layers(self, ids, rope, cache: KVCache, attention, hidden_layers: Sequence[int]):
        x = self.embed_tokens(ids)  # [T, H]
        wanted = {layer: None for layer in hidden_layers}
        for index, layer in enumerate(self.layers):
            x = layer(x, rope, cache, index, attention)
            if index in wanted:
                wanted[index] = x
        x = self.norm(x)
        if self.config.num_hidden_layers - 1 in wanted:  # HF's last hidden state is the normed one
            wanted[self.config.num_hidden_layers - 1] = x
        hidden = torch.cat([wanted[i] for i in hidden_layers], dim=-1) if hidden_layers else None
        return x, hidden

    def commit(
        self, cache: KVCache, accepted: torch.Tensor, pending: tuple = (), parents=None
    ) -> None:
        """Keep the accepted path [K]; a dense pass leaves nothing else (`pending`, `parents`:
        the target interface's, see engine/models/qwen3_5.py)."""
        cache.commit(accepted)

    def commit_batch(self, commits: list[tuple[KVCache, list[int]]]) -> None:
        """`commit` of each (cache, accepted path) after one `forward_batch`."""
        commit_paths([cache for cache, _ in commits], [path for _, path in commits])


def qwen3_checkpoint(model_dir: str | Path) -> tuple[Qwen3Model, Callable[[str], str | None]]:
    """The model of an HF directory built on meta, and its checkpoint names' parameter names."""
    cfg = Qwen3Config.from_dict(read_config(model_dir))
    with torch.device("meta"):
        model = Qwen3Model(cfg)

    def rename(name: str) -> str | None:
        if name.startswith("lm_head.") and cfg.tie_word_embeddings:
            return None
        return name.removeprefix("model.")

    return model, rename


def load_qwen3(
    model_dir: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> Qwen3Model:
    """A dense Qwen3 from an HF directory (config.json + safetensors, sharded or not), loaded
    tensor by tensor in `dtype` on `device`."""
    model, rename = qwen3_checkpoint(model_dir)
    return finish_loading(model, model_dir, rename, dtype, device)
