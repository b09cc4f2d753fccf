"""The memory plan: what serving a target (and its DFlash drafter) needs on one device, from the
models' config.json files alone.

Pure arithmetic, no torch import, so the ops control plane can hold a plan against a host's GPUs
before anything is created:

    plan = plan_from_dirs("Qwen3.6-27B", "Qwen3.6-27B-DFlash", "bfloat16", 96 * GIB, 40000)
    plan.longest_context, plan.total_bytes(32768), plan.problem()  # None, or why not

What it counts, per device (under tensor parallelism: rank 0, which also holds the embeddings,
the whole lm_head and the drafter):
- weights: every parameter the engine builds, at the dtype's width (embeddings and an untied
  lm_head included; the vision tower and `mtp.*`, never loaded, are not);
- KV bytes per token: the target's attention layers and the drafter's layers (K and V); while a
  speculative prefill is in flight also the prompt's context features for the drafter (the
  outputs of its target layers, kept until the first draft), so they count per token too;
- recurrent state: each Gated DeltaNet layer's conv window (model dtype) and delta-rule state
  (float32; float64 for float64), once per sequence;
- `sequences` decoding at once (serve's --max-num-seqs, engine/scheduler.py): each has caches
  for the whole served context (its slot), its recurrent state and its share of a batched
  verify pass, so the per-token and per-sequence figures count `sequences` times; or, with
  `kv_cache_tokens` (serve's --kv-cache-tokens), they share one KV pool of that many tokens
  (each still its recurrent state and verify share; the scheduler preempts when it runs short);
  `sequences_fitting(context)` is how many fit at a context, `problem()` says why
  `sequences` at the asked context do not (and how many do);
- the largest transient: a prefill chunk (the widest layer's live activations for
  `prefill_chunk` tokens, and one row of float32 logits) or a verify round (`verify_tokens`
  tokens through the widest layer, their logits, what the GDN layers keep for commit, the
  drafter's block); the chunk's itemised activations are planned at TRANSIENT_SLACK (1.5x),
  set against measurements in engine/NOTES.md;
- RESERVE_BYTES for the runtime itself (CUDA context and allocator slack, the process);
- the prefix cache (engine/prefix_cache.py): `prefix_cache_memory` bytes when asked for, else
  what the served context leaves (the context keeps its priority; a context that fills the
  device leaves the cache nothing). A cached token costs the target's and the drafter's K/V
  (`cached_bytes_per_token`), a GDN snapshot the recurrent state of every GDN layer
  (`snapshot_bytes`); `conversations_held(tokens)` is how many conversations of that length fit
  (one snapshot per prefill chunk, the prompt's and the generation's ends, their tails);
- the KV block pools (engine/kv_blocks.py): blocks of BLOCK_TOKENS tokens (`block_bytes`, the
  target's and the drafter's), which running sequences and the prefix cache share (a hit hands
  its blocks over, `hit_shared_bytes`).
The longest context is what the rest leaves, divided by the bytes per token, less one draft
block (the caches hold a round beyond the context), capped by the model's
max_position_embeddings. Not counted: the CPU attention's [chunk, context] bool mask (2 KiB per
token at the default chunk, ~1.5% of Qwen3.6-27B's per-token bytes).

`python -m engine plan --model DIR [--draft DIR] --dtype bfloat16 --device-memory 96GiB
[--max-model-len N] [--tp N] [--prefix-cache-memory SIZE | --no-enable-prefix-caching] [--json]`
prints it (engine/cli/plan.py).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, replace
from pathlib import Path

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float64": 8}
RESERVE_BYTES = GIB
DEFAULT_PREFILL_CHUNK = 2048
DEFAULT_VERIFY_TOKENS = 16  # a ddtree budget of 15, or a DFlash chain of 15, and the bonus
CHAIN_PIECE = 64  # tokens a chain is solved in at once (engine/kernels/batched.py): its decay rows
# The itemised activations leave out the allocator's slack and short-lived copies: a 2048-token
# chunk measured 1.3x them on the CPU (engine/NOTES.md), so a chunk is planned at 1.5x.
TRANSIENT_SLACK = 1.5
BLOCK_TOKENS = 256  # tokens per prefix-cache KV block (engine/prefix_cache.py)
CONVERSATION_TOKENS = 32768  # the conversation length the plan counts the prefix cache in
MAX_NUM_SEQS = 1024  # the most sequences at once serve and an inventory may ask for
DEFAULT_MAX_NUM_SEQS = 4  # serve's sequences at once without --max-num-seqs (if they fit)
FULL, LINEAR = "full_attention", "linear_attention"
_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "k": KIB,
    "kib": KIB,
    "m": MIB,
    "mib": MIB,
    "g": GIB,
    "gib": GIB,
    "t": 1 << 40,
    "tib": 1 << 40,
}


def planned_sequences(max_num_seqs: int | None, kv_cache_tokens: int | None, tp: int) -> int | None:
    """The sequences a serve command's plan counts: one under tensor parallelism (its ranks run
    one at a time), else --max-num-seqs, else DEFAULT_MAX_NUM_SEQS beside a shared KV pool;
    None: serve takes as many as fit at the served context (up to DEFAULT_MAX_NUM_SEQS), and
    a plan made before that is known counts one."""
    if tp > 1:
        return 1
    if max_num_seqs is not None:
        return max_num_seqs
    return DEFAULT_MAX_NUM_SEQS if kv_cache_tokens is not None else None


def parse_size(text: str) -> int:
    """Bytes in "96GiB", "80GB", "512M" (K/M/G/T alone are binary), "1024"; ValueError else."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match and match.group(2).lower()
    if not match or unit not in _SIZE_UNITS:
        raise ValueError(f"not a size: {text!r} (e.g. 96GiB, 80GB, 512MiB)")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether an error is an allocation that did not fit: torch.OutOfMemoryError (CUDA), a CPU
    allocation torch could not make, a MemoryError (the plan was wrong, or others took memory)."""
    text = str(exc)
    return (
        isinstance(exc, MemoryError)
        or type(exc).__name__ == "OutOfMemoryError"
        or "can't allocate memory" in text
        or "out of memory" in text.lower()
    )


def hybrid_layer_types(text_config: dict) -> tuple[str, ...]:
    """A Qwen3.5/3.6 text config's layer types: its `layer_types`, else every
    `full_attention_interval`-th layer (default 4) full attention and the rest GDN."""
    interval = text_config.get("full_attention_interval", 4)
    types = text_config.get("layer_types") or [
        FULL if (i + 1) % interval == 0 else LINEAR for i in range(text_config["num_hidden_layers"])
    ]
    return tuple(types)


def _local(count: int, tp: int, what: str, replicate: bool = False) -> int:
    """This rank's share of `count` heads or rows; KV heads (`replicate`) are copied onto
    several ranks when tp exceeds them."""
    if replicate and tp >= count and tp % count == 0:
        return 1
    if count % tp:
        raise ValueError(f"{what}: {count} is not divisible by tp {tp}")
    return count // tp


def factored_elements(value_heads: int, key_dim: int, value_dim: int, tokens: int) -> int:
    """Elements one GDN layer's factors of a `tokens`-token pass hold (engine/kernels/batched.py,
    a chain in CHAIN_PIECE pieces): per node its key, write and start decay; each piece's
    [piece, piece] path decays; per piece after the first, the state it starts from."""
    piece = max(1, min(tokens, CHAIN_PIECE))
    pieces, rest = divmod(tokens, piece)
    decay_rows = pieces * piece * piece + rest * rest
    starts = key_dim * value_dim * max(0, pieces + (rest > 0) - 1)
    return value_heads * (tokens * (key_dim + value_dim + 1) + decay_rows + starts)


@dataclass(frozen=True)
class TargetShape:
    """The sizes of a dense Qwen3 or hybrid Qwen3.5/3.6 target that memory depends on."""

    vocab: int
    hidden: int
    intermediate: int
    layer_types: tuple[str, ...]
    heads: int
    kv_heads: int
    head_dim: int
    gated_attention: bool  # Qwen3.5/3.6: q_proj also produces a sigmoid output gate
    tied: bool
    max_position_embeddings: int
    gdn_key_heads: int = 0
    gdn_value_heads: int = 0
    gdn_key_dim: int = 0
    gdn_value_dim: int = 0
    conv_kernel: int = 0

    @classmethod
    def from_config(cls, config: dict) -> TargetShape:
        """From a target's config.json: `qwen3`, `qwen3_5_text`, or `qwen3_5` (its text_config)."""
        model_type = config.get("model_type")
        text = config.get("text_config", config)
        common = dict(
            vocab=text["vocab_size"],
            hidden=text["hidden_size"],
            intermediate=text["intermediate_size"],
            heads=text["num_attention_heads"],
            kv_heads=text["num_key_value_heads"],
            head_dim=text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"],
            tied=config.get("tie_word_embeddings", text.get("tie_word_embeddings", False)),
            max_position_embeddings=text.get("max_position_embeddings", 32768),
        )
        if model_type == "qwen3":
            return cls(
                **common, layer_types=(FULL,) * text["num_hidden_layers"], gated_attention=False
            )
        if model_type not in ("qwen3_5", "qwen3_5_text"):
            raise ValueError(f"unsupported target model_type {model_type!r}")
        return cls(
            **common,
            layer_types=hybrid_layer_types(text),
            gated_attention=True,
            gdn_key_heads=text.get("linear_num_key_heads", 16),
            gdn_value_heads=text.get("linear_num_value_heads", 32),
            gdn_key_dim=text.get("linear_key_head_dim", 128),
            gdn_value_dim=text.get("linear_value_head_dim", 128),
            conv_kernel=text.get("linear_conv_kernel_dim", 4),
        )

    def count(self, layer_type: str) -> int:
        return sum(t == layer_type for t in self.layer_types)

    def local(self, tp: int) -> dict[str, int]:
        """Rank-local head and row counts."""
        return {
            "heads": _local(self.heads, tp, "num_attention_heads"),
            "kv_heads": _local(self.kv_heads, tp, "num_key_value_heads", replicate=True),
            "intermediate": _local(self.intermediate, tp, "intermediate_size"),
            "key_heads": _local(self.gdn_key_heads, tp, "linear_num_key_heads")
            if self.gdn_key_heads
            else 0,
            "value_heads": _local(self.gdn_value_heads, tp, "linear_num_value_heads")
            if self.gdn_value_heads
            else 0,
        }

    def conv_dim(self, tp: int = 1) -> int:
        n = self.local(tp)
        return 2 * n["key_heads"] * self.gdn_key_dim + n["value_heads"] * self.gdn_value_dim

    def parameters(self, tp: int = 1) -> int:
        """Parameters on rank 0: the embeddings, the whole lm_head, its share of every layer."""
        n, H, D = self.local(tp), self.hidden, self.head_dim
        q_width = (2 if self.gated_attention else 1) * n["heads"] * D
        attention = H * q_width + 2 * H * n["kv_heads"] * D + n["heads"] * D * H + 2 * D
        v_width = n["value_heads"] * self.gdn_value_dim
        gdn = (
            H * self.conv_dim(tp)  # in_proj_qkv
            + H * v_width  # in_proj_z
            + 2 * H * n["value_heads"]  # in_proj_a, in_proj_b
            + self.conv_dim(tp) * self.conv_kernel  # conv1d
            + 2 * n["value_heads"]  # A_log, dt_bias
            + self.gdn_value_dim  # the gated norm
            + v_width * H  # out_proj
        )
        per_layer = 3 * H * n["intermediate"] + 2 * H  # MLP and the two norms
        layers = self.count(FULL) * (attention + per_layer) + self.count(LINEAR) * (gdn + per_layer)
        head = 0 if self.tied else self.vocab * H
        return self.vocab * H + head + layers + H

    def kv_bytes_per_token(self, width: int, tp: int = 1) -> int:
        return self.count(FULL) * 2 * self.local(tp)["kv_heads"] * self.head_dim * width

    def recurrent_bytes(self, width: int, state_width: int, tp: int = 1) -> int:
        """Conv windows and delta-rule states of every GDN layer: one sequence's."""
        n = self.local(tp)
        conv = self.conv_dim(tp) * (self.conv_kernel - 1) * width
        state = n["value_heads"] * self.gdn_key_dim * self.gdn_value_dim * state_width
        return self.count(LINEAR) * (conv + state)

    def activation_bytes_per_token(self, width: int, compute: int, tp: int = 1) -> int:
        """Live activations of one token in the widest layer: the residual stream (and its
        normed copy and the mixer's output) plus the widest of the MLP, attention and GDN."""
        n, H, D = self.local(tp), self.hidden, self.head_dim
        residual = 3 * H * width + H * compute
        mlp = 3 * n["intermediate"] * width
        q_width = (2 if self.gated_attention else 1) * n["heads"] * D
        attention = (q_width + 2 * n["kv_heads"] * D) * width + 3 * n["heads"] * D * compute
        v_width = n["value_heads"] * self.gdn_value_dim
        gdn = (
            self.conv_dim(tp) * (2 * width + 2 * compute)  # conv inputs, outputs, compute copies
            + 2 * n["value_heads"] * self.gdn_key_dim * compute  # q, k per value head
            + v_width * (2 * width + 2 * compute)  # v, z, the rule's output and its norm
            # the CPU's batched solve keeps, per token and head, its key, write and decay row
            + n["value_heads"] * (self.gdn_key_dim + self.gdn_value_dim + CHAIN_PIECE) * compute
        )
        return residual + max(mlp, attention, gdn if self.count(LINEAR) else 0)

    def verify_pending_bytes(self, tokens: int, width: int, compute: int, tp: int = 1) -> int:
        """What the GDN layers keep for commit over a verify round, the more of a lone round's
        (replaying the accepted path: conv inputs and outputs, beta, g per node) and a
        batched pass's (its trees solved factored: conv inputs, and per head a node's key,
        write, start decay and row of path decays; engine/models/gated_deltanet.py)."""
        n = self.local(tp)
        replay = (2 * self.conv_dim(tp) * width + n["value_heads"] * (width + compute)) * tokens
        factors = factored_elements(n["value_heads"], self.gdn_key_dim, self.gdn_value_dim, tokens)
        factored = self.conv_dim(tp) * width * tokens + factors * compute
        return self.count(LINEAR) * max(replay, factored)


@dataclass(frozen=True)
class DraftShape:
    """The sizes of a z-lab DFlash drafter (it borrows the target's embeddings and lm_head)."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    target_layers: int

    @classmethod
    def from_config(cls, config: dict) -> DraftShape:
        dflash = config.get("dflash_config", {})
        return cls(
            hidden=config["hidden_size"],
            intermediate=config["intermediate_size"],
            layers=config["num_hidden_layers"],
            heads=config["num_attention_heads"],
            kv_heads=config["num_key_value_heads"],
            head_dim=config.get("head_dim")
            or config["hidden_size"] // config["num_attention_heads"],
            block_size=dflash.get("block_size", config.get("block_size", 16)),
            target_layers=len(dflash.get("target_layer_ids", config.get("target_layer_ids", ()))),
        )

    def parameters(self) -> int:
        H, D = self.hidden, self.head_dim
        attention = 2 * H * self.heads * D + 2 * H * self.kv_heads * D + 2 * D
        layer = attention + 3 * H * self.intermediate + 2 * H
        return self.target_layers * H * H + 2 * H + self.layers * layer  # fc, two norms, layers

    def kv_bytes_per_token(self, width: int) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * width

    def context_bytes_per_token(self, width: int) -> int:
        """The target features one prompt token gives the drafter (held until the first draft)."""
        return self.target_layers * self.hidden * width

    def block_bytes(self, vocab: int, width: int, compute: int) -> int:
        """One draft: the block through the widest layer, and its float32 logits."""
        per_token = 3 * self.hidden * width + 3 * self.intermediate * width
        return self.block_size * (per_token + vocab * compute)


@dataclass(frozen=True)
class Plan:
    """Bytes on one device (rank 0 under tensor parallelism); see the module docstring."""

    dtype: str
    tp: int
    device_memory: int
    target_weights: int
    draft_weights: int
    target_kv_per_token: int
    draft_kv_per_token: int
    context_features_per_token: int
    recurrent_state: int
    prefill_transient: int
    verify_transient: int
    reserve: int
    draft_block: int  # tokens the caches hold beyond the context
    model_limit: int  # the target's max_position_embeddings
    prefill_chunk: int
    verify_tokens: int
    max_model_len: int | None = None  # the context asked for, if any (see `problem`)
    vocab: int = 0
    prefix_caching: bool = True
    prefix_cache_memory: int | None = None  # asked for; None: what the served context leaves
    sequences: int = 1  # decoding at once, each in its own slot of the served context
    kv_cache_tokens: int | None = None  # the sequences share a KV pool of this many tokens

    @property
    def weights(self) -> int:
        return self.target_weights + self.draft_weights

    @property
    def bytes_per_token(self) -> int:
        return self.target_kv_per_token + self.draft_kv_per_token + self.context_features_per_token

    @property
    def transient(self) -> int:
        """A prefill chunk's, or a batched verify pass of every sequence's round."""
        return max(self.prefill_transient, self.sequences * self.verify_transient)

    @property
    def fixed_bytes(self) -> int:
        """Everything that does not grow with the context (a prefix cache asked for included)."""
        asked = self.prefix_cache_memory if self.prefix_caching else None
        states = self.sequences * self.recurrent_state
        return self.weights + states + self.transient + self.reserve + (asked or 0)

    @property
    def cached_bytes_per_token(self) -> int:
        """What the prefix cache keeps per token: the target's and the drafter's K/V."""
        return self.target_kv_per_token + self.draft_kv_per_token

    @property
    def snapshot_bytes(self) -> int:
        """One GDN snapshot: every GDN layer's conv window and recurrent state."""
        return self.recurrent_state

    @property
    def served_context(self) -> int:
        return self.max_model_len or self.longest_context

    @property
    def prefix_cache_bytes(self) -> int:
        """The prefix cache's budget (0: off)."""
        if not self.prefix_caching:
            return 0
        if self.prefix_cache_memory is not None:
            return self.prefix_cache_memory
        return max(0, self.device_memory - self.total_bytes(self.served_context))

    def conversation_bytes(self, tokens: int, chunk_snapshots: bool = False) -> int:
        """The prefix cache's bytes for one conversation of `tokens` that its next turn resumes:
        their K/V, the snapshots at the last prompt's and generation's ends with their tails
        (at most a block each) and the prompt end's logits; `chunk_snapshots`: also one per
        prefill chunk (what a divergence inside the history resumes from; evicted first)."""
        snapshots = 2 + (tokens // self.prefill_chunk if chunk_snapshots else 0)
        tails = 2 * BLOCK_TOKENS * self.cached_bytes_per_token
        logits = self.vocab * (8 if self.dtype == "float64" else 4)
        kv = tokens * self.cached_bytes_per_token
        return kv + snapshots * self.snapshot_bytes + tails + logits

    def conversations_held(self, tokens: int = CONVERSATION_TOKENS, chunk_snapshots=False) -> int:
        return self.prefix_cache_bytes // self.conversation_bytes(tokens, chunk_snapshots)

    @property
    def block_bytes(self) -> int:
        """One KV block of BLOCK_TOKENS tokens in the target's pool and the drafter's together
        (engine/kv_blocks.py: one pool per model, the prefix cache's blocks among them)."""
        return BLOCK_TOKENS * self.cached_bytes_per_token

    def hit_shared_bytes(self, tokens: int = CONVERSATION_TOKENS) -> int:
        """What a prefix-cache hit of `tokens` hands over by reference instead of copying: the
        target's and the drafter's K/V of its whole blocks (the tail block is copied on its
        first write, a GDN snapshot's states are copied)."""
        return tokens // BLOCK_TOKENS * self.block_bytes

    @property
    def longest_fit(self) -> int:
        """The longest context the device's memory holds, whatever the model's own limit (with
        a shared KV pool: what the pool holds for one sequence, if the pool fits)."""
        room = self.device_memory - self.fixed_bytes
        if self.kv_cache_tokens is not None:
            return max(0, self.kv_cache_tokens - self.draft_block) if self.pool_fits else 0
        return max(0, room // (self.sequences * self.bytes_per_token) - self.draft_block)

    @property
    def pool_fits(self) -> bool:
        """Whether a shared KV pool of kv_cache_tokens fits beside the rest (True without one)."""
        return self.kv_cache_tokens is None or self.total_bytes(0) <= self.device_memory

    @property
    def longest_context(self) -> int:
        return min(self.longest_fit, self.model_limit)

    def total_bytes(self, context: int) -> int:
        """The peak at a context of `context` tokens (every sequence's slot that long, or the
        shared KV pool of kv_cache_tokens: its tokens' K/V and a prefill's drafter features)."""
        if self.kv_cache_tokens is not None:
            return self.fixed_bytes + self.kv_cache_tokens * self.bytes_per_token
        return self.fixed_bytes + self.sequences * self.sequence_kv_bytes(context)

    def sequence_kv_bytes(self, context: int) -> int:
        """One sequence's slot: its caches for `context` tokens and a draft block."""
        return (context + self.draft_block) * self.bytes_per_token

    def sequences_fitting(self, context: int) -> int:
        """How many sequences of `context` tokens fit at once beside the weights, the largest
        transient and a prefix cache asked for (each its slot, recurrent state and verify share):
        the most for which `total_bytes(context)` stays within the device; with a shared KV pool,
        how many of its slots' worth it holds at once (beyond them the scheduler preempts)."""
        if self.kv_cache_tokens is not None:
            return self.kv_cache_tokens // (context + self.draft_block) if self.pool_fits else 0
        asked = (self.prefix_cache_memory or 0) if self.prefix_caching else 0
        room = self.device_memory - self.weights - self.reserve - asked
        each = self.sequence_kv_bytes(context) + self.recurrent_state
        # total = n * each + max(prefill, n * verify): within room iff both sums are
        return max(
            0, min((room - self.prefill_transient) // each, room // (each + self.verify_transient))
        )

    @property
    def sequence_bytes(self) -> int:
        """What one more sequence at once costs at the served context: its slot, its recurrent
        state and its round's share of the verify pass."""
        return self._each_bytes(self.served_context)

    def problem(self, max_model_len: int | None = None) -> str | None:
        """Why `sequences` sequences of `max_model_len` tokens (default: the context asked
        for) do not fit at once, with the numbers; None if they do (or no context was asked)."""
        max_model_len = max_model_len or self.max_model_len
        if not self.pool_fits:
            room = self.device_memory - self.fixed_bytes
            return (
                f"kv_cache_tokens {self.kv_cache_tokens} needs {self.total_bytes(0) / GIB:.2f} GiB "
                f"but the device has {self.device_memory / GIB:.2f} GiB (weights "
                f"{self.weights / GIB:.2f} GiB, {self.bytes_per_token / KIB:.1f} KiB per token); "
                f"at most {max(0, room // self.bytes_per_token)} tokens fit"
            )
        if max_model_len is None or max_model_len <= self.longest_fit:
            return None
        if self.kv_cache_tokens is not None:
            return (
                f"max_model_len {max_model_len} does not fit a KV pool of {self.kv_cache_tokens} "
                f"tokens: a sequence alone needs {max_model_len + self.draft_block}"
            )
        fitting = self.sequences_fitting(max_model_len)
        if not fitting:
            one = replace(self, sequences=1)
            return (
                f"max_model_len {max_model_len} needs {one.total_bytes(max_model_len) / GIB:.2f} "
                f"GiB for one sequence but the device has {self.device_memory / GIB:.2f} GiB "
                f"(weights {self.weights / GIB:.2f} GiB, {self.bytes_per_token / KIB:.1f} KiB per "
                f"token); the longest context that fits is {one.longest_fit} tokens"
            )
        return (
            f"{self.sequences} sequences of {max_model_len} tokens need "
            f"{self.total_bytes(max_model_len) / GIB:.2f} GiB but the device has "
            f"{self.device_memory / GIB:.2f} GiB (weights {self.weights / GIB:.2f} GiB, "
            f"{self._each_bytes(max_model_len) / GIB:.2f} GiB a sequence); {fitting} fit at that "
            f"length, or {self.sequences} at up to {self.longest_fit} tokens"
        )

    def _each_bytes(self, context: int) -> int:
        """What one more sequence of `context` tokens costs: its slot, recurrent state, verify share."""
        return self.sequence_kv_bytes(context) + self.recurrent_state + self.verify_transient

    def to_dict(self) -> dict:
        return {
            **asdict(self),
            "weights": self.weights,
            "bytes_per_token": self.bytes_per_token,
            "transient": self.transient,
            "longest_fit": self.longest_fit,
            "longest_context": self.longest_context,
            "cached_bytes_per_token": self.cached_bytes_per_token,
            "snapshot_bytes": self.snapshot_bytes,
            "prefix_cache_bytes": self.prefix_cache_bytes,
            "conversations_held": self.conversations_held(),
            "sequence_bytes": self.sequence_bytes,
            "sequences_fitting": self.sequences_fitting(CONVERSATION_TOKENS),
            "block_bytes": self.block_bytes,
            "hit_shared_bytes": self.hit_shared_bytes(),
        }

    def lines(self) -> list[str]:
        """The plan as text, one figure a line."""

        def size(n: int) -> str:
            return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / MIB:.1f} MiB"

        return [
            f"device memory        {size(self.device_memory)} ({self.dtype}, tp {self.tp}, rank 0)",
            f"target weights       {size(self.target_weights)}",
            f"drafter weights      {size(self.draft_weights)}",
            f"KV per token         {self.target_kv_per_token / KIB:.1f} KiB target + "
            f"{self.draft_kv_per_token / KIB:.1f} KiB drafter + "
            f"{self.context_features_per_token / KIB:.1f} KiB drafter features",
            f"recurrent state      {size(self.recurrent_state)} per sequence",
            f"prefill transient    {size(self.prefill_transient)} (chunk of {self.prefill_chunk})",
            f"verify transient     {size(self.verify_transient)} ({self.verify_tokens} tokens)",
            f"runtime reserve      {size(self.reserve)}",
            self._sequences_line(size),
            f"longest context      {self.longest_context} tokens (memory allows "
            f"{self.longest_fit}, the model {self.model_limit})",
            self._prefix_cache_line(size),
            f"KV blocks            {BLOCK_TOKENS} tokens: "
            f"{size(BLOCK_TOKENS * self.target_kv_per_token)} target + "
            f"{size(BLOCK_TOKENS * self.draft_kv_per_token)} drafter (one pool per model, "
            f"the prefix cache's blocks shared: a {CONVERSATION_TOKENS}-token hit hands over "
            f"{size(self.hit_shared_bytes())}, nothing copied)",
        ]

    def _sequences_line(self, size) -> str:
        line = f"sequences at once    {self.sequences}, "
        if self.kv_cache_tokens is None:
            return line + (
                f"{size(self.sequence_bytes)} each at the served context (its caches, recurrent "
                f"state and verify share); {self._fitting_text()} fit"
            )
        return line + (
            f"sharing a KV pool of {self.kv_cache_tokens} tokens "
            f"({size(self.kv_cache_tokens * self.bytes_per_token)}): {self._fitting_text()} at "
            f"once, beyond that the scheduler preempts"
        )

    def _fitting_text(self) -> str:
        """How many sequences fit at the served context (and at CONVERSATION_TOKENS)."""
        text = f"{self.sequences_fitting(self.served_context)} of {self.served_context} tokens"
        if self.served_context != CONVERSATION_TOKENS:
            fitting = self.sequences_fitting(CONVERSATION_TOKENS)
            text += f" ({fitting} of {CONVERSATION_TOKENS})"
        return text

    def _prefix_cache_line(self, size) -> str:
        if not self.prefix_cache_bytes:
            return "prefix cache         off" + ("" if self.prefix_caching else " (asked)")
        held = f"{self.conversations_held()} conversations of {CONVERSATION_TOKENS} tokens"
        snapshot = ""
        if self.snapshot_bytes:
            snapshot = f", {size(self.snapshot_bytes)} per GDN snapshot"
            held += f" ({self.conversations_held(chunk_snapshots=True)} with chunk snapshots)"
        return (
            f"prefix cache         {size(self.prefix_cache_bytes)} beside a context of "
            f"{self.served_context} ({self.cached_bytes_per_token / KIB:.1f} KiB per cached token"
            f"{snapshot}): {held}"
        )


def plan_from_configs(
    target_config: dict,
    draft_config: dict | None,
    dtype: str,
    device_memory: int,
    max_model_len: int | None = None,
    tp: int = 1,
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
    verify_tokens: int = DEFAULT_VERIFY_TOKENS,
    prefix_caching: bool = True,
    prefix_cache_memory: int | None = None,
    sequences: int = 1,
    kv_cache_tokens: int | None = None,
) -> Plan:
    """The plan for these config.json dicts (the drafter's may be None) on a device of
    `device_memory` bytes."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_BYTES)}, not {dtype!r}")
    if min(tp, prefill_chunk, verify_tokens, sequences) < 1:
        raise ValueError("tp, prefill_chunk, verify_tokens and sequences must be at least 1")
    if prefix_cache_memory is not None and prefix_cache_memory < 0:
        raise ValueError("the prefix cache's memory cannot be negative")
    if kv_cache_tokens is not None and kv_cache_tokens < 1:
        raise ValueError("kv_cache_tokens must be at least 1")
    width = DTYPE_BYTES[dtype]
    compute = 8 if dtype == "float64" else 4
    target = TargetShape.from_config(target_config)
    draft = DraftShape.from_config(draft_config) if draft_config else None
    activation = target.activation_bytes_per_token(width, compute, tp)
    logits_row = target.vocab * compute
    verify = (
        verify_tokens * (activation + logits_row)
        + target.verify_pending_bytes(verify_tokens, width, compute, tp)
        + (draft.block_bytes(target.vocab, width, compute) if draft else 0)
    )
    return Plan(
        dtype=dtype,
        tp=tp,
        device_memory=device_memory,
        target_weights=target.parameters(tp) * width,
        draft_weights=draft.parameters() * width if draft else 0,
        target_kv_per_token=target.kv_bytes_per_token(width, tp),
        draft_kv_per_token=draft.kv_bytes_per_token(width) if draft else 0,
        context_features_per_token=draft.context_bytes_per_token(width) if draft else 0,
        recurrent_state=target.recurrent_bytes(width, compute, tp),
        prefill_transient=int(TRANSIENT_SLACK * prefill_chunk * activation) + logits_row,
        verify_transient=verify,
        reserve=RESERVE_BYTES,
        draft_block=draft.block_size if draft else 0,
        model_limit=target.max_position_embeddings,
        prefill_chunk=prefill_chunk,
        verify_tokens=verify_tokens,
        max_model_len=max_model_len,
        vocab=target.vocab,
        prefix_caching=prefix_caching,
        prefix_cache_memory=prefix_cache_memory,
        sequences=sequences,
        kv_cache_tokens=kv_cache_tokens,
    )


def plan_from_dirs(
    target_dir: str | Path,
    draft_dir: str | Path | None,
    dtype: str,
    device_memory: int,
    max_model_len: int | None = None,
    tp: int = 1,
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
    verify_tokens: int = DEFAULT_VERIFY_TOKENS,
    prefix_caching: bool = True,
    prefix_cache_memory: int | None = None,
    sequences: int = 1,
    kv_cache_tokens: int | None = None,
) -> Plan:
    """`plan_from_configs` with the config.json of each model directory."""

    def config(path) -> dict:
        return json.loads((Path(path) / "config.json").read_text())

    return plan_from_configs(
        config(target_dir),
        config(draft_dir) if draft_dir else None,
        dtype,
        device_memory,
        max_model_len,
        tp,
        prefill_chunk,
        verify_tokens,
        prefix_caching,
        prefix_cache_memory,
        sequences,
        kv_cache_tokens,
    )
