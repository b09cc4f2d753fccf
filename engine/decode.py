"""One round loop for autoregressive (`ar`), DFlash chain (`linear`) and DDTree (`ddtree`) decoding.

The prompt is prefilled in chunks of `prefill_chunk` tokens (the target's `extend`: each chunk
committed as it runs, logits of the last token only), so a prefill's activations are bounded by
the chunk, not the prompt. With a server's `CachePool` (engine/cache_pool.py) the sequence decodes
in the server's caches and starts from the longest prefix of its prompt the prefix cache holds
(`cache_prompt`): the prefill runs the rest, in the chunks a cold prefill would, and at the end
what was committed (the prompt and the output but its last token) is stored. Each round, with `bonus` the target's latest choice (already output, not yet in the KV cache):
    draft   the drafter reads the context features of the tokens committed last round and
            proposes logits for the next B-1 positions after `bonus` (skipped for `ar`);
    tree    a chain of the drafter's argmax (`linear`) or the DDTree best-first tree (`ddtree`);
    verify  one target pass over [bonus, nodes...] with the tree's ancestor mask;
    commit  walk the tree with the target's choices (argmax or seeded sample at each node), keep
            the accepted path's KV entries; the first miss is the next bonus token.
Every output token is the target's own choice given its path, so all three methods produce the
same tokens at temperature 0 and the same distribution at temperature > 0. A choice honours the
request's sampling settings and grammar at its own path (engine/sampling.py: penalties counted
along the path, warps; engine/grammar.py: the tree holds grammar-valid tokens only, each verify
index is masked with its node's grammar state, computed on the host while the verify runs).

With `logprobs` asked, each choice's logprob (and alternatives) is computed beside it on the
device and read back in the same read (engine/sampling.py's `choose_scored`); the prompt's
(`prompt_logprobs`) are scored chunk by chunk inside the prefill's `extend` (no prefix reuse).

The tree is shrunk so a round never writes past the KV cache and never outputs more than
`max_new_tokens`.

On the device a round waits for it at most twice (three with a trace): reading the draft back
(top-k, or the chain's argmax) and reading the target's choices back for the walk. Everything
else is sent ahead: the verify's tokens and tree (parents, depths, ancestor mask) in one
non-blocking copy, the accepted path in another. Passes run with static shapes when the models
have them (`forward_static`, `draft_static`): the verify always `width` tokens (the bonus, the
draft, padding that no real node sees), the ar step one token, lengths on the device, attention
over a fixed window of cache slots; on CUDA each is captured once as a CUDA graph and replayed
(`cuda_graphs`, on by default), elsewhere the same code runs eagerly. Usage:

    result = generate(target, drafter, prompt_ids, GenerationConfig(method="ddtree", budget=15))
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import torch

from engine.cache_pool import CachePool, chunk_bounds
from engine.grammar import Constraint, Guide, mask_logits
from engine.memory_plan import is_out_of_memory
from engine.methods import METHODS, TREE_METHODS
from engine.models.common import key_window
from engine.models.dflash import DraftInputs
from engine.sampling import (
    MAX_TOP_LOGPROBS,
    NO_SAMPLING,
    Penalties,
    PromptScores,
    Sampling,
    TokenLogprob,
    choose_scored,
    greedy,
    make_generator,
    read_scored,
)
from engine.transfer import on_device, staged, to_device
from engine.tree import (
    DraftTree,
    TopK,
    build_tree,
    chain_tree,
    pack_pass,
    packed_size,
    padded_parents,
    path_tokens,
    top_k_log_probs,
    unpack_pass,
    walk,
)

log = logging.getLogger(__name__)

STAGES = ("prefill", "draft", "tree", "verify", "commit")
# A sequence's kept features are joined once it holds this many rounds' pieces (`keep`). A
# piece may be a view of its step's gathered rows, every sequence's, so the last 4 steps'
# gathers stay alive at most: at Qwen3.6-27B's five 5120-wide taps in bf16 (50 KiB a row), 16
# sequences accepting 16 tokens each make that 50 MiB, 16 plain rounds 3.1 MiB (computed).
KEEP_PIECES = 4


@dataclass
class GenerationConfig:
    method: str = "ddtree"  # "ar" | "linear" (DFlash chain of B-1) | "ddtree" | "auto"
    budget: int = 15  # ddtree node budget (verify = budget + 1 tokens); auto's cap
    max_new_tokens: int = 256
    temperature: float = 0.0  # 0 = greedy
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    trace: bool = False
    prefill_chunk: int = 2048  # prompt tokens per target pass: bounds a prefill's activations
    cuda_graphs: bool = True  # on CUDA: replay the static passes as captured CUDA graphs
    sampling: Sampling = NO_SAMPLING  # top_p, top_k, min_p and the penalties (engine/sampling.py)
    constraint: Constraint | None = None  # a grammar the output follows (engine/grammar.py)
    cache_prompt: bool = True  # with a pool's prefix cache: reuse and extend it
    checkpoints: tuple[int, ...] = ()  # prompt positions a prefill chunk ends at (snapshots)
    logprobs: int | None = None  # each output token's logprob and this many alternatives
    prompt_logprobs: int | None = None  # the prompt's too (prefilled whole: no prefix reuse)


@dataclass
class GenerationResult:
    output_ids: list[int]
    finish_reason: str  # "stop" | "length" | "cancelled"
    acceptance_lengths: list[int]  # tokens committed per round, bonus included
    stage_seconds: dict[str, float]  # prefill, draft, tree, verify, commit
    decode_tokens_per_s: float
    ttft_s: float
    rounds: list[dict] | None  # with trace: {"tree": {"tokens", "parents"}, "accepted"}
    round_seconds: list[dict[str, float]] | None = None  # with trace: each round's stage seconds
    cached_tokens: int = 0  # prompt tokens the prefix cache held (not prefilled)
    budgets: list[int] | None = None  # auto: the nodes each round verified (0: plain decoding)
    logprobs: list[TokenLogprob] | None = None  # with cfg.logprobs: one per output token
    prompt_logprobs: list[TokenLogprob | None] | None = None  # with cfg.prompt_logprobs


class _StageClock:
    """Seconds per stage. On CUDA a stage is timed by events recorded on the stream, so nothing
    waits for the device until `seconds` is read (at the end, or every round for a trace)."""

    def __init__(self, device: torch.device) -> None:
        self._seconds = dict.fromkeys(STAGES, 0.0)
        self._cuda = device.type == "cuda"
        self._events: list[tuple[str, Any, Any]] = []
        self._read = dict(self._seconds)  # the totals when `since_last` was last called

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        if self._cuda:
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            yield
            end.record()
            self._events.append((name, start, end))
            return
        start = time.perf_counter()
        yield
        self._seconds[name] += time.perf_counter() - start

    @property
    def seconds(self) -> dict[str, float]:
        if self._events:
            self._events[-1][2].synchronize()
            for name, start, end in self._events:
                self._seconds[name] += start.elapsed_time(end) / 1000
            self._events.clear()
        return dict(self._seconds)

    def since_last(self) -> dict[str, float]:
        """Seconds per stage since the previous call (the first: since the start)."""
        now = self.seconds
        spent = {name: now[name] - self._read[name] for name in STAGES}
        self._read = now
        return spent


class StaticPass:
    """One static-shape pass over device buffers. `run()` reads only `buffers`; a call copies
    its values into them (non-blocking) and runs it: with `graphs`, as a CUDA graph captured
    on the first call and replayed after (its outputs are then the same tensors every time),
    in `memory` (a graph memory pool, shared by passes of which one runs at a time) if given.
    The first call runs it once before capturing (Triton compiles, the allocator settles); a
    pass that `commits` (writes state it also reads: engine/step_passes.py) returns that run's
    outputs instead of replaying, so every call runs it once (a capture runs nothing). A pass
    CUDA cannot capture (an op that is not graph-safe there) is logged once and runs eagerly
    from then on: the run before the capture did the call's work, so nothing is lost; running
    out of memory while capturing is raised as it is (the caller's to handle)."""

    def __init__(
        self,
        run: Callable[[], Any],
        buffers: dict[str, torch.Tensor],
        graphs: bool,
        memory: Any = None,
        commits: bool = False,
    ) -> None:
        self.run, self.buffers, self.graphs, self.memory = run, buffers, graphs, memory
        self.commits = commits
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs: Any = None

    def __call__(self, **values: torch.Tensor) -> Any:
        for name, value in values.items():
            self.buffers[name][: value.shape[0]].copy_(value, non_blocking=True)
        if not self.graphs:
            return self.run()
        if self.graph is None:
            warm = self._capture()
            if self.commits or self.graph is None:
                return warm
        self.graph.replay()
        return self.outputs

    def _capture(self) -> Any:
        """Run once on a side stream, then capture (`graph` None and `graphs` off if CUDA
        cannot); the run's outputs."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            warm = self.run()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(self.graph, pool=self.memory):
                self.outputs = self.run()
        except Exception as error:
            if is_out_of_memory(error):
                self.graph = None
                raise
            log.warning(
                "a static pass could not be captured as a CUDA graph, so it runs eagerly: %s", error
            )
            self.graph, self.graphs, self.outputs = None, False, None
        return warm


class _Passes:
    """Static passes, one per kind, kept in the pool so they outlive a request. A pass reads a
    window of cache slots: with `graphs` one as wide as needed or wider is reused (its graph
    was captured once; the kernels read the device-side length), else the pass is rebuilt for
    exactly the window needed (the CPU's attention costs the whole window). A kind is a name
    ("verify", "draft") and its shape (a request's budget): with `graphs` at most HELD_SHAPES
    shapes of a name are kept, the least recently used dropped, so requests of many budgets do
    not pile up captured graphs (each holds its activations' memory)."""

    HELD_SHAPES = 3

    def __init__(self, passes: dict[tuple, tuple[int, StaticPass]], graphs: bool) -> None:
        self._passes, self._graphs = passes, graphs

    def get(self, kind: tuple, keys: int, build: Callable[[int], StaticPass]) -> StaticPass:
        held = self._passes.pop(kind, None)  # put back last: the order is their last use
        if held is not None:
            self._passes[kind] = held
        elif self._graphs:
            shapes = [other for other in self._passes if other[0] == kind[0]]
            for other in shapes[: len(shapes) - self.HELD_SHAPES + 1]:
                del self._passes[other]
        if held is None or held[0] < keys or (held[0] != keys and not self._graphs):
            held = self._passes[kind] = (keys, build(keys))
        return held[1]


@dataclass
class _Output:
    """The output so far: enforces stop tokens and max_new_tokens, streams each round's tokens."""

    cfg: GenerationConfig
    on_tokens: Callable[[list[int]], None] | None
    on_logprobs: Callable[[list[TokenLogprob]], None] | None = None  # called before on_tokens
    ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None  # with cfg.logprobs: the output's

    @property
    def remaining(self) -> int:
        return self.cfg.max_new_tokens - len(self.ids)

    def taking(self, tokens: list[int]) -> int:
        """How many of `tokens` `add` takes: up to and including a stop token or the limit."""
        for count, token in enumerate(tokens, 1):
            if token in self.cfg.stop_token_ids or len(self.ids) + count == self.cfg.max_new_tokens:
                return count
        return len(tokens)

    def add(self, tokens: list[int], logprobs: list[TokenLogprob] | None = None) -> int:
        """Append tokens up to and including a stop token or the length limit; returns how many.
        `logprobs`: the tokens' own, kept (and handed on) for the tokens taken."""
        taken = tokens[: self.taking(tokens)]
        if logprobs is not None and taken:
            self.logprobs = [*(self.logprobs or []), *logprobs[: len(taken)]]
            if self.on_logprobs:
                self.on_logprobs(logprobs[: len(taken)])
        if taken and taken[-1] in self.cfg.stop_token_ids:
            self.finish_reason = "stop"
        elif len(self.ids) + len(taken) == self.cfg.max_new_tokens:
            self.finish_reason = "length"
        self.ids.extend(taken)
        if self.on_tokens and taken:
            self.on_tokens(taken)
        return len(taken)


def _check(cfg: GenerationConfig, drafter) -> None:
    if cfg.method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, not {cfg.method!r}")
    if cfg.method != "ar" and drafter is None:
        raise ValueError(f"method {cfg.method!r} needs a drafter")
    if cfg.method in TREE_METHODS and cfg.budget < 1:
        raise ValueError(f"{cfg.method} budget must be >= 1, not {cfg.budget}")
    if cfg.max_new_tokens < 1 or cfg.temperature < 0:
        raise ValueError("max_new_tokens must be >= 1 and temperature >= 0")
    if cfg.prefill_chunk < 1:
        raise ValueError(f"prefill_chunk must be >= 1, not {cfg.prefill_chunk}")
    if cfg.constraint and not set(cfg.constraint.stop_token_ids) <= set(cfg.stop_token_ids):
        raise ValueError("the grammar's stop tokens must be among stop_token_ids")
    for name in ("logprobs", "prompt_logprobs"):
        if not 0 <= (getattr(cfg, name) or 0) <= MAX_TOP_LOGPROBS:
            raise ValueError(f"{name} must be in [0, {MAX_TOP_LOGPROBS}] or None")


class _Sequence:
    """One sequence's decoding state and the four round steps over it (see the module docstring)."""

    def __init__(self, target, drafter, cfg: GenerationConfig, pool: CachePool) -> None:
        self.target, self.drafter, self.cfg = target, drafter, cfg
        self.device = target.embed_tokens.weight.device
        self.speculative = cfg.method != "ar"
        self.layers = tuple(drafter.target_layer_ids) if self.speculative else ()
        self.generator = make_generator(self.device, cfg.seed) if cfg.temperature > 0 else None
        self.clock = _StageClock(self.device)
        self.graphs = cfg.cuda_graphs and self.device.type == "cuda"
        self._open(pool)
        self.committed: list[int] = []  # the token ids in the target's cache
        self._kept: list[torch.Tensor] = []  # the drafter's features not yet given to it
        self._rounds_kept = 0  # rounds' pieces at the end of `_kept` not joined yet
        self.context_rows = 0  # how many tokens' features `_kept` holds (joined or not)
        self.bonus = -1  # the target's latest choice: output, not yet in the cache
        self.width = 1 + _draft_width(cfg, drafter)  # tokens of every static verify
        self.static_target = hasattr(target, "forward_static")
        self.static_draft = self.speculative and getattr(drafter, "static_ok", False)
        self.resuming = False  # re-prefilling `committed` after a preemption (`restart`)
        self.guide = Guide(cfg.constraint) if cfg.constraint else None
        self.penalties: Penalties | None = None  # made at the prefill's logits (their width)
        self.scores: list[TokenLogprob] | None = None  # with cfg.logprobs: the last choices'
        self.prompt_scores: PromptScores | None = None  # with cfg.prompt_logprobs

    @property
    def context(self) -> torch.Tensor | None:
        """[N, n*H] the drafter's features of the tokens not yet given to it (None: none).
        Kept as the rounds' pieces and joined once, when read (a draft, or the prefix cache's
        store): a sequence that skips drafting (`auto` on a busy batch) would otherwise copy
        all of them every round, its prompt's included (at 27B, 50 KiB a token)."""
        if len(self._kept) > 1:
            self._kept, self._rounds_kept = [torch.cat(self._kept)], 0
        return self._kept[0] if self._kept else None

    @context.setter
    def context(self, features: torch.Tensor | None) -> None:
        self._kept, self._rounds_kept = [] if features is None else [features], 0
        self.context_rows = 0 if features is None else features.shape[0]

    def keep(self, features: torch.Tensor) -> None:
        """The features [K, n*H] of the tokens a round committed, for the drafter. They may be
        a view of a batched step's gathered rows (every sequence's): the last KEEP_PIECES
        rounds' are joined into a piece of their own, so a sequence that skips drafting holds
        no more than that many steps' rows (the pieces before, its prompt's among them, are
        not copied again)."""
        self._kept.append(features)
        self.context_rows += features.shape[0]
        self._rounds_kept += 1
        if self._rounds_kept == KEEP_PIECES:
            self._kept[-KEEP_PIECES:] = [torch.cat(self._kept[-KEEP_PIECES:])]
            self._rounds_kept = 0

    def _open(self, pool: CachePool) -> None:
        """Decode in `pool`'s caches (a server's slot) and static passes."""
        cfg = self.cfg
        self.caches = pool.open(self.speculative, cfg.cache_prompt and cfg.prompt_logprobs is None)
        self.cache, self.draft_cache = self.caches.cache, self.caches.draft_cache
        self.passes = _Passes(pool.passes, self.graphs)

    def prefill(self, prompt_ids: list[int]) -> int:
        """Run the prompt from its longest cached prefix in chunks of cfg.prefill_chunk, each
        committed as it goes; the bonus comes from the last token's logits (the only ones
        computed, or kept by the prefix cache when it held the whole prompt)."""
        with self.clock.stage("prefill"):
            self.begin_prefill(prompt_ids)
            while (piece := self.next_piece()) is not None:
                logits, hidden = self._extend(piece, self.prefilled)
                self.piece_done(piece.shape[0], logits, hidden)
            return self.end_prefill()

    def begin_prefill(self, prompt_ids: list[int]) -> None:
        """Restore the longest cached prefix and plan the chunks of the rest (`next_piece`)."""
        self.prompt_ids = list(prompt_ids)
        self._plan_prefill(self.prompt_ids)
        if self.cfg.prompt_logprobs is not None:
            self.prompt_scores = PromptScores(prompt_ids, self.cfg.prompt_logprobs, self.device)

    def _plan_prefill(self, tokens: list[int], whole: bool = False) -> None:
        """Restore the longest cached prefix of `tokens` (the prompt, or what a preempted
        sequence had committed: `whole`, it may be all of them) and plan the chunks of the
        rest."""
        cached, total = self.caches.resume(tokens, whole), len(tokens)
        self._filling, self.prefilled = tokens, cached
        self._cached, self._logits = cached, self.caches.logits
        self._prompt = torch.tensor(tokens[cached:], dtype=torch.long, device=self.device)
        if self.speculative:  # the drafter's features of the uncached tokens
            self.context = self._features(total - cached)
        self._chunk_ends = [
            end
            for _, end in chunk_bounds(cached, total, self.cfg.prefill_chunk, self.cfg.checkpoints)
        ]

    @property
    def prefill_left(self) -> int:
        """Prompt tokens (or a resumed sequence's committed ones) not yet prefilled."""
        return len(self._filling) - self.prefilled

    @property
    def scoring_prompt(self) -> bool:
        """Whether the prefill scores every prompt position (prompt logprobs; not a resume)."""
        return self.prompt_scores is not None and not self.resuming

    def preempt(self) -> None:
        """Give back the caches (every KV block, the GDN state slot, the drafter's features),
        keeping the tokens and the sampling state (generator, penalties, grammar; the output is
        the Run's): `restart` re-prefills what was committed. Between rounds, what was committed
        is stored in the prefix cache first (the drafter's last features appended when the pool
        has the blocks), so the restart resumes from it, all of it when nothing was evicted."""
        if self.committed and not self.resuming:
            self.caches.finish(self.committed, self.context)
        else:
            self.caches.abandon()
        self.release()
        self.context = self._prompt = self._logits = None

    def release(self) -> None:
        """Give the caches' blocks back now (those the prefix cache holds stay with it), not
        when the slot's next sequence opens it: a pool shared by many slots needs them."""
        self.cache.reset()
        if self.draft_cache is not None:
            self.draft_cache.reset()

    def restart(self, pool: CachePool) -> None:
        """After `preempt`: take `pool`'s caches and plan the re-prefill, from its longest cached
        prefix, of what was committed (the prompt and the output but the bonus; the prompt
        alone if it was not all prefilled). The bonus, the sampling state and the output stay:
        the next round continues where the sequence stopped (`end_resume`)."""
        cached_tokens = self.caches.cached_tokens
        self._open(pool)
        if not self.committed:
            self.begin_prefill(self.prompt_ids)
            return
        self.resuming = True
        self._plan_prefill(self.committed, whole=True)
        self.caches.cached_tokens = cached_tokens  # the result reports the prompt's hit

    def end_resume(self) -> None:
        """The re-prefill after a preemption is in: the caches hold `committed` again."""
        self.resuming = False

    def next_piece(self, limit: int | None = None) -> torch.Tensor | None:
        """The prompt's next tokens to extend the cache with: the rest of the current chunk,
        at most `limit` of them (a scheduler's share of a pass); None when all are in."""
        if not self._chunk_ends:
            return None
        start = self.prefilled
        end = self._chunk_ends[0] if limit is None else min(self._chunk_ends[0], start + limit)
        return self._prompt[start - self._cached : end - self._cached]

    def piece_done(self, count: int, logits: torch.Tensor, hidden: torch.Tensor | None) -> None:
        """The `count` tokens of `next_piece` ran through `extend` (logits of the last, the
        requested layers' features of all): features kept, a chunk's end snapshotted."""
        start = self.prefilled
        self.prefilled = end = start + count
        if hidden is not None:
            self.context[start - self._cached : end - self._cached] = hidden
        self._logits = logits
        if end == self._chunk_ends[0]:
            self._chunk_ends.pop(0)
            self.caches.after_chunk(end, len(self._filling), logits)

    def end_prefill(self) -> int:
        """The first output token, from the prompt's last logits."""
        logits = self._logits
        if self.cfg.sampling.penalized:
            self.penalties = Penalties(self.cfg.sampling, logits.shape[-1], self.device)
            self.penalties.start(self.prompt_ids)
        choices, self.scores = self._choose(logits, None)
        self.bonus = choices[0]
        self._advance([0], self.bonus)
        self.committed = list(self.prompt_ids)
        return self.bonus

    def _extend(self, chunk: torch.Tensor, start: int):
        """The target's extend of the prefill chunk at prompt position `start`, every position
        scored when the prompt's logprobs are asked."""
        if not self.scoring_prompt:
            return self.target.extend(chunk, self.cache, self.layers)
        return self.target.extend(chunk, self.cache, self.layers, self.prompt_scores.at(start))

    def _features(self, count: int) -> torch.Tensor:  # [count, n*H]
        width = len(self.layers) * self.target.config.hidden_size
        dtype = self.target.embed_tokens.weight.dtype
        return torch.empty(count, width, dtype=dtype, device=self.device)

    def _choose(
        self, logits: torch.Tensor, tree: DraftTree | None
    ) -> tuple[list[int], list[TokenLogprob] | None]:
        """The target's choice at verify indices 0..n of `tree` (None: the prefill's last token)
        under the grammar's state and the penalties along each index's own path, read back (one
        read), with their logprobs when cfg.logprobs asks."""
        return read_scored(*self._scored(logits, tree))

    def _scored(
        self, logits: torch.Tensor, tree: DraftTree | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`_choose` left on the device: the choices [n] and, when asked, their scores (a
        batched step reads every sequence's at once: sampling.read_scored_together)."""
        if self.guide is not None:
            masks = self.guide.masks(logits.shape[0])  # host work while the device computes
            logits = mask_logits(logits, to_device(masks, self.device))
        if self.penalties is not None:
            logits = self.penalties.apply(logits, path_tokens(tree) if tree else None)
        cfg = self.cfg
        return choose_scored(logits, cfg.temperature, self.generator, cfg.sampling, cfg.logprobs)

    def logprobs_of(self, accepted: list[int]) -> list[TokenLogprob] | None:
        """The logprobs of the tokens chosen at the `accepted` verify indices (a round's new
        tokens), when asked."""
        return None if self.scores is None else [self.scores[i] for i in accepted]

    def _advance(self, accepted: list[int], next_bonus: int, tokens: Sequence[int] = ()) -> None:
        """The grammar and the penalties follow the output: `tokens`, then the next bonus."""
        if self.guide is not None:
            self.guide.advance(accepted, next_bonus)
        if self.penalties is not None:
            self.penalties.add([*tokens, next_bonus])

    def propose(self, depth_room: int, node_room: int) -> DraftTree:
        """The draft to verify after the bonus: empty for ar or when nothing more fits."""
        if not self.start_round(depth_room, node_room):
            return chain_tree(np.zeros(0, np.int64))
        with self.clock.stage("draft"):
            logits = self._draft()
            self.context = None
        return self.shape(logits, depth_room, node_room)

    def start_round(self, depth_room: int, node_room: int) -> bool:
        """Begin a round (the grammar's); whether it drafts (`may_draft`)."""
        if self.guide is not None:
            self.guide.start_round()
        return self.may_draft(depth_room, node_room)

    def may_draft(self, depth_room: int, node_room: int) -> bool:
        """Whether a round with these rooms drafts: not ar, and something fits."""
        return self.speculative and min(depth_room, node_room) > 0

    def shape(
        self, logits: torch.Tensor, depth_room: int, node_room: int, top: TopK | None = None
    ) -> DraftTree:
        """The round's tree from the drafter's logits [B-1, V] (`top`: their top-k, read back
        already beside other sequences')."""
        with self.clock.stage("tree"):
            return _shape_draft(self.cfg, logits, depth_room, node_room, self.guide, top)

    def trim(self, tree: DraftTree, count: int) -> DraftTree:
        """The round's tree cut to its first `count` nodes (a budget chosen after the draft,
        engine/budgets.py); the grammar keeps the states of those alone."""
        if self.guide is not None:
            del self.guide.nodes[count + 1 :]
        return tree.first(count)

    def _draft(self) -> torch.Tensor:  # [B-1, V]
        """The drafter's logits after the bonus: a static pass unless the context is longer
        than a round commits (the prompt's, after the prefill) or nears the cache's end."""
        cache, count = self.draft_cache, self.context.shape[0]
        needed = cache.length + self.width + self.drafter.block_size
        if not self.static_draft or count > self.width or needed > cache.max_len:
            return self.drafter.draft(self.target, cache, self.context, self.bonus)
        keys = self._key_window(needed, cache.max_len)
        cache.check_room(self.width + self.drafter.block_size)  # a paged cache's blocks, ahead
        rows = self.width if self.graphs else count  # padding serves a captured graph only
        step = self.passes.get(("draft", rows), keys, partial(self._draft_pass, rows=rows))
        scalars = staged(np.array([cache.length, count, self.bonus], np.int64), self.device)
        logits = step(context=self.context, scalars=scalars)
        cache.length += count
        return logits

    def _key_window(self, needed: int, capacity: int) -> int:
        """The cache slots a static pass reads: with graphs a shared window (few captures),
        else exactly those needed (eager attention costs every slot it reads: at a 300-token
        context the window's 512 slots cost a CPU attention ~1.4x the 316 it needs)."""
        return key_window(needed, capacity) if self.graphs else needed

    def _draft_pass(self, keys: int, rows: int) -> StaticPass:
        width = self.context.shape[1]
        context = torch.zeros(rows, width, dtype=self.context.dtype, device=self.device)
        scalars = torch.zeros(3, dtype=torch.long, device=self.device)
        inputs = DraftInputs(context, *scalars)
        run = partial(self.drafter.draft_static, self.target, self.draft_cache, inputs, keys)
        return StaticPass(run, {"context": context, "scalars": scalars}, self.graphs)

    def verify(self, tree: DraftTree) -> tuple[list[int], torch.Tensor | None, tuple | None]:
        """The target's choice at every verify index, the drafter's features of each, and what
        commit needs beyond the cache (None after a dynamic-shape pass)."""
        with self.clock.stage("verify"):
            n = tree.size + 1
            if self.static_target and self.cache.length + self.width <= self.cache.max_len:
                logits, hidden, pending = self._verify_static(tree)
            else:
                logits, hidden, pending = self._verify_growing(tree)
            choices, self.scores = self._choose(logits[:n], tree)
            return choices, hidden, pending

    def _verify_static(self, tree: DraftTree):
        """[bonus, nodes..., padding] as one static pass of `width` tokens."""
        ids = np.zeros(self.width, np.int64)
        ids[0], ids[1 : tree.size + 1] = self.bonus, tree.tokens
        parents = padded_parents(tree.verify_parents(), self.width)
        keys = self._key_window(self.cache.length + self.width, self.cache.max_len)
        self.cache.check_room(self.width)  # a paged cache's blocks, ahead of the pass
        step = self.passes.get(("verify", self.width, self.layers), keys, self._verify_pass)
        packed = staged(pack_pass(ids, parents, self.cache.length), self.device)
        return step(packed=packed)

    def _verify_pass(self, keys: int) -> StaticPass:
        packed = torch.zeros(packed_size(self.width), dtype=torch.long, device=self.device)
        inputs = unpack_pass(packed, self.width)
        run = partial(self.target.forward_static, inputs, self.cache, keys, self.layers)
        return StaticPass(run, {"packed": packed}, self.graphs)

    def _verify_growing(self, tree: DraftTree):
        """[bonus, nodes...] through `forward` (a target without static passes, or the last
        rounds of a cache without room for a full-width verify)."""
        ids, parents = self.verify_inputs(tree)
        return (*self.target.forward(ids, self.cache, parents, self.layers), None)

    def verify_inputs(self, tree: DraftTree) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The dynamic-shape verify's token ids [bonus, nodes...] and parents (None: a chain,
        as the bonus alone is)."""
        ids = to_device(np.array([self.bonus, *tree.tokens.tolist()], np.int64), self.device)
        if self.cfg.method not in TREE_METHODS or tree.size == 0:
            return ids, None
        return ids, torch.from_numpy(tree.verify_parents())

    def commit(
        self,
        tree: DraftTree,
        choices: list[int],
        hidden,
        pending: tuple | None,
        taking: Callable[[list[int]], int],
        defer: Callable[[list[int]], None] | None = None,
    ) -> tuple[list[int], list[int]]:
        """Walk the tree and commit the accepted path, cut where `taking` says the output ends
        (so the cache holds the output but its last token, what a next turn extends); returns
        (accepted verify indices, new tokens). `defer`: the cache's part and the kept features
        are left to the caller, `defer` called with the kept path (a batched pass's: its
        caches committed and its features gathered at once, `hidden` unused)."""
        with self.clock.stage("commit"):
            accepted, next_bonus = walk(tree, choices)
            drafted = [int(tree.tokens[i - 1]) for i in accepted[1:]]
            new_tokens = [*drafted, next_bonus]
            kept = accepted[: taking(new_tokens)]
            self.committed += [self.bonus, *new_tokens[: len(kept) - 1]]
            if defer is not None:
                defer(kept)
            else:
                self._commit_alone(kept, hidden, pending, tree)
            self._advance(accepted, next_bonus, drafted)
        self.bonus = next_bonus
        return accepted, new_tokens

    def _commit_alone(self, kept: list[int], hidden, pending: tuple | None, tree: DraftTree):
        """The cache's commit of the path `kept` and its features, of a pass of its own."""
        host_path = torch.tensor(kept, dtype=torch.long)
        path = on_device(host_path, self.device)
        if pending is not None:
            parents = padded_parents(tree.verify_parents(), self.width).tolist()
            self.target.commit(self.cache, host_path, pending, parents=parents)
        else:
            self.target.commit(self.cache, path)
        if self.speculative:
            self.keep(hidden.index_select(0, path))

    def finish(self) -> None:
        """Store what the sequence committed in the pool's prefix cache (if it uses one; not
        while a preempted one re-prefills it: the caches hold part of it). The drafter's
        features are joined only to be stored (~80 us a demo request's)."""
        if self.resuming:
            self.caches.abandon()
        elif self.caches.prefix is not None:
            self.caches.finish(self.committed, self.context)


def generate(
    target,
    drafter,
    prompt_ids: list[int],
    cfg: GenerationConfig,
    *,
    max_len: int | None = None,
    on_tokens: Callable[[list[int]], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    pool: CachePool | None = None,
    on_logprobs: Callable[[list[TokenLogprob]], None] | None = None,
) -> GenerationResult:
    """Generate up to cfg.max_new_tokens after prompt_ids; max_len bounds the KV cache (tokens).

    The default max_len leaves room for a full draft on top of the longest output, so only
    max_new_tokens (never the cache) shrinks the last rounds' drafts. `pool`: a server's caches
    and prefix cache (engine/cache_pool.py), which also bound max_len; without one the caches
    are made for this request alone. With cfg.logprobs, `on_logprobs` is given each round's
    tokens' logprobs just before `on_tokens` is given the tokens.
    """
    _check(cfg, drafter)
    max_len = max_len or len(prompt_ids) + cfg.max_new_tokens + _draft_width(cfg, drafter)
    if pool is not None:
        max_len = min(max_len, pool.max_len)
    if not 0 < len(prompt_ids) <= max_len:
        raise ValueError(f"prompt of {len(prompt_ids)} tokens does not fit max_len {max_len}")
    started = time.perf_counter()
    pool = pool or CachePool(target, drafter if cfg.method != "ar" else None, max_len)
    seq = _Sequence(target, drafter, cfg, pool)
    try:
        result = _decode(seq, prompt_ids, max_len, started, on_tokens, should_stop, on_logprobs)
    except BaseException:
        seq.caches.abandon()
        raise
    seq.finish()
    return result


def _decode(
    seq: _Sequence,
    prompt_ids: list[int],
    max_len: int,
    started: float,
    on_tokens: Callable[[list[int]], None] | None,
    should_stop: Callable[[], bool] | None,
    on_logprobs: Callable[[list[TokenLogprob]], None] | None = None,
) -> GenerationResult:
    """The prefill and the rounds of `generate`."""
    run = Run(seq, max_len, started, on_tokens, on_logprobs)
    run.prefilled(seq.prefill(prompt_ids))
    while (tree := run.next_tree(should_stop)) is not None:
        run.committed(tree, *seq.commit(tree, *seq.verify(tree), run.out.taking))
    return run.result()


class Run:
    """A sequence's generation: its output, acceptance and trace over the rounds, whoever
    drives them (`generate` alone, or engine/scheduler.py beside other sequences)."""

    def __init__(
        self,
        seq: _Sequence,
        max_len: int,
        started: float,
        on_tokens: Callable[[list[int]], None] | None,
        on_logprobs: Callable[[list[TokenLogprob]], None] | None = None,
    ) -> None:
        self.seq, self.max_len, self.started = seq, max_len, started
        self.out = _Output(seq.cfg, on_tokens, on_logprobs)
        self.acceptance: list[int] = []
        self.rounds: list[dict] | None = [] if seq.cfg.trace else None
        self.round_seconds: list[dict[str, float]] = []
        self.budgets: list[int] | None = [] if seq.cfg.method == "auto" else None
        self.ttft = 0.0

    def prefilled(self, bonus: int) -> None:
        """The prefill chose `bonus`, the first output token."""
        self.out.add([bonus], self.seq.logprobs_of([0]))
        self.ttft = time.perf_counter() - self.started
        if self.rounds is not None:
            self.seq.clock.since_last()  # round_seconds: each round's own

    def next_tree(self, should_stop: Callable[[], bool] | None) -> DraftTree | None:
        """The next round's draft, or None when the output is finished (its reason set)."""
        rooms = self.next_rooms(should_stop)
        return None if rooms is None else self.seq.propose(*rooms)

    def next_rooms(self, should_stop: Callable[[], bool] | None) -> tuple[int, int] | None:
        """The next round's (depth room, node room) for its draft, or None when the output is
        finished (its reason set)."""
        out = self.out
        if out.finish_reason is not None:
            return None
        if should_stop is not None and should_stop():
            out.finish_reason = "cancelled"
            return None
        node_room = self.max_len - self.seq.cache.length - 1  # the bonus takes one slot
        if node_room < 0:
            out.finish_reason = "length"
            return None
        return out.remaining - 1, node_room  # -1: the next bonus

    def committed(self, tree: DraftTree, accepted: list[int], new_tokens: list[int]) -> None:
        """A round committed `accepted` of `tree`, giving `new_tokens`."""
        self.acceptance.append(self.out.add(new_tokens, self.seq.logprobs_of(accepted)))
        if self.budgets is not None:
            self.budgets.append(tree.size)
        if self.rounds is not None:
            self.rounds.append(_trace(tree, accepted))
            self.round_seconds.append(self.seq.clock.since_last())

    def result(self) -> GenerationResult:
        seq, out = self.seq, self.out
        decode_seconds = time.perf_counter() - self.started - self.ttft
        decoded = len(out.ids) - 1
        return GenerationResult(
            output_ids=out.ids,
            finish_reason=out.finish_reason,
            acceptance_lengths=self.acceptance,
            stage_seconds=seq.clock.seconds,
            decode_tokens_per_s=decoded / decode_seconds if decoded and decode_seconds > 0 else 0.0,
            ttft_s=self.ttft,
            rounds=self.rounds,
            round_seconds=self.round_seconds if self.rounds is not None else None,
            cached_tokens=seq.caches.cached_tokens,
            budgets=self.budgets,
            logprobs=out.logprobs if seq.cfg.logprobs is not None else None,
            prompt_logprobs=seq.prompt_scores.read() if seq.prompt_scores is not None else None,
        )


def _draft_width(cfg: GenerationConfig, drafter) -> int:
    """The most draft nodes one round verifies."""
    if cfg.method == "ar":
        return 0
    return drafter.block_size - 1 if cfg.method == "linear" else cfg.budget


def _shape_draft(
    cfg: GenerationConfig,
    logits: torch.Tensor,
    depth_room: int,
    node_room: int,
    guide: Guide | None,
    top: TopK | None = None,
) -> DraftTree:
    """The round's draft from logits [B-1, V]: a chain or a DDTree within the rooms left, of
    grammar-valid tokens only under a guide (a chain ends at its first refused token). A tree
    reads `top`, the logits' top-k log-probs and ids [B-1, budget], when given."""
    depth = min(logits.shape[0], depth_room, node_room)
    if cfg.method == "linear":
        chain = greedy(logits[:depth]).cpu().numpy()
        return chain_tree(chain[: guide.valid_prefix(chain.tolist())] if guide else chain)
    if top is None:
        log_probs, token_ids = top_k_log_probs(logits[:depth], cfg.budget)
    else:
        log_probs, token_ids = top[0][:depth], top[1][:depth]
    allow = guide.allow if guide else None
    return build_tree(log_probs, token_ids, min(cfg.budget, node_room), allow)


def _trace(tree: DraftTree, accepted: list[int]) -> dict:
    return {
        "tree": {"tokens": tree.tokens.tolist(), "parents": tree.parents.tolist()},
        "accepted": accepted[1:],
    }
