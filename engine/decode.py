"""One round loop for autoregressive (`ar`), DFlash chain (`linear`) and DDTree (`ddtree`) decoding.

The prompt is prefilled in chunks of `prefill_chunk` tokens (the target's `extend`: each chunk
committed as it runs, logits of the last token only), so a prefill's activations are bounded by
the chunk, not the prompt. Each round, with `bonus` the target's latest choice (already output, not yet in the KV cache):
    draft   the drafter reads the context features of the tokens committed last round and
            proposes logits for the next B-1 positions after `bonus` (skipped for `ar`);
    tree    a chain of the drafter's argmax (`linear`) or the DDTree best-first tree (`ddtree`);
    verify  one target pass over [bonus, nodes...] with the tree's ancestor mask;
    commit  walk the tree with the target's choices (argmax or seeded sample at each node), keep
            the accepted path's KV entries; the first miss is the next bonus token.
Every output token is the target's own choice given its path, so all three methods produce the
same tokens at temperature 0 and the same distribution at temperature > 0.

The tree is shrunk so a round never writes past the KV cache and never outputs more than
`max_new_tokens`. Usage:

    result = generate(target, drafter, prompt_ids, GenerationConfig(method="ddtree", budget=15))
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.sampling import choose, make_generator
from engine.tree import DraftTree, build_tree, chain_tree, top_k_log_probs, walk

METHODS = ("ar", "linear", "ddtree")
STAGES = ("prefill", "draft", "tree", "verify", "commit")


@dataclass
class GenerationConfig:
    method: str = "ddtree"  # "ar" | "linear" (DFlash chain of B-1) | "ddtree"
    budget: int = 15  # ddtree node budget (verify = budget + 1 tokens)
    max_new_tokens: int = 256
    temperature: float = 0.0  # 0 = greedy
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    trace: bool = False
    prefill_chunk: int = 2048  # prompt tokens per target pass: bounds a prefill's activations


@dataclass
class GenerationResult:
    output_ids: list[int]
    finish_reason: str  # "stop" | "length" | "cancelled"
    acceptance_lengths: list[int]  # tokens committed per round, bonus included
    stage_seconds: dict[str, float]  # prefill, draft, tree, verify, commit
    decode_tokens_per_s: float
    ttft_s: float
    rounds: list[dict] | None  # with trace: {"tree": {"tokens", "parents"}, "accepted"}


class _StageClock:
    """Seconds per stage; synchronises CUDA at stage edges so GPU work lands in its own stage."""

    def __init__(self, device: torch.device) -> None:
        self.seconds = dict.fromkeys(STAGES, 0.0)
        self._cuda = device.type == "cuda"

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        self._sync()
        start = time.perf_counter()
        yield
        self._sync()
        self.seconds[name] += time.perf_counter() - start

    def _sync(self) -> None:
        if self._cuda:
            torch.cuda.synchronize()


@dataclass
class _Output:
    """The output so far: enforces stop tokens and max_new_tokens, streams each round's tokens."""

    cfg: GenerationConfig
    on_tokens: Callable[[list[int]], None] | None
    ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None

    @property
    def remaining(self) -> int:
        return self.cfg.max_new_tokens - len(self.ids)

    def add(self, tokens: list[int]) -> int:
        """Append tokens up to and including a stop token or the length limit; returns how many."""
        taken = []
        for token in tokens:
            taken.append(token)
            if token in self.cfg.stop_token_ids:
                self.finish_reason = "stop"
                break
            if len(self.ids) + len(taken) == self.cfg.max_new_tokens:
                self.finish_reason = "length"
                break
        self.ids.extend(taken)
        if self.on_tokens and taken:
            self.on_tokens(taken)
        return len(taken)


def _check(cfg: GenerationConfig, drafter) -> None:
    if cfg.method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, not {cfg.method!r}")
    if cfg.method != "ar" and drafter is None:
        raise ValueError(f"method {cfg.method!r} needs a drafter")
    if cfg.method == "ddtree" and cfg.budget < 1:
        raise ValueError(f"ddtree budget must be >= 1, not {cfg.budget}")
    if cfg.max_new_tokens < 1 or cfg.temperature < 0:
        raise ValueError("max_new_tokens must be >= 1 and temperature >= 0")
    if cfg.prefill_chunk < 1:
        raise ValueError(f"prefill_chunk must be >= 1, not {cfg.prefill_chunk}")


class _Sequence:
    """One sequence's decoding state and the four round steps over it (see the module docstring)."""

    def __init__(self, target, drafter, cfg: GenerationConfig, max_len: int) -> None:
        self.target, self.drafter, self.cfg = target, drafter, cfg
        self.device = target.embed_tokens.weight.device
        self.speculative = cfg.method != "ar"
        self.layers = tuple(drafter.target_layer_ids) if self.speculative else ()
        self.generator = make_generator(self.device, cfg.seed) if cfg.temperature > 0 else None
        self.clock = _StageClock(self.device)
        self.cache = target.new_cache(max_len)
        self.draft_cache = drafter.new_cache(max_len) if self.speculative else None
        self.context: torch.Tensor | None = None  # [N, n*H] features not yet given to the drafter
        self.bonus = -1  # the target's latest choice: output, not yet in the cache

    def prefill(self, prompt_ids: list[int]) -> int:
        """Run the prompt in chunks of cfg.prefill_chunk, each committed as it goes; the bonus
        comes from the last token's logits (the only ones computed)."""
        with self.clock.stage("prefill"):
            prompt = torch.tensor(prompt_ids, dtype=torch.long, device=self.device)
            for start in range(0, len(prompt_ids), self.cfg.prefill_chunk):
                chunk = prompt[start : start + self.cfg.prefill_chunk]
                logits, hidden = self.target.extend(chunk, self.cache, self.layers)
                if hidden is not None:
                    if self.context is None:  # the drafter's features of the whole prompt
                        self.context = hidden.new_empty(len(prompt_ids), hidden.shape[1])
                    self.context[start : start + len(chunk)] = hidden
            self.bonus = int(choose(logits, self.cfg.temperature, self.generator)[0])
        return self.bonus

    def propose(self, depth_room: int, node_room: int) -> DraftTree:
        """The draft to verify after the bonus: empty for ar or when nothing more fits."""
        if not self.speculative or min(depth_room, node_room) <= 0:
            return chain_tree(np.zeros(0, np.int64))
        with self.clock.stage("draft"):
            logits = self.drafter.draft(self.target, self.draft_cache, self.context, self.bonus)
            self.context = None
        with self.clock.stage("tree"):
            return _shape_draft(self.cfg, logits, depth_room, node_room)

    def verify(self, tree: DraftTree) -> tuple[list[int], torch.Tensor | None]:
        """The target's choice at every verify index, and the drafter's features of each."""
        with self.clock.stage("verify"):
            ids = [self.bonus, *tree.tokens.tolist()]
            ids = torch.tensor(ids, dtype=torch.long, device=self.device)  # [1 + n]
            parents = (
                None if self.cfg.method != "ddtree" else torch.from_numpy(tree.verify_parents())
            )
            logits, hidden = self.target.forward(ids, self.cache, parents, self.layers)
            return choose(logits, self.cfg.temperature, self.generator).tolist(), hidden

    def commit(self, tree: DraftTree, choices: list[int], hidden) -> tuple[list[int], list[int]]:
        """Walk and commit the accepted path; returns (accepted verify indices, new tokens)."""
        with self.clock.stage("commit"):
            accepted, next_bonus = walk(tree, choices)
            path = torch.tensor(accepted, dtype=torch.long, device=self.device)
            self.target.commit(self.cache, path)
            if self.speculative:
                fresh = hidden[path]  # [K, n*H] features of the newly committed tokens
                self.context = fresh if self.context is None else torch.cat([self.context, fresh])
        self.bonus = next_bonus
        return accepted, [int(tree.tokens[i - 1]) for i in accepted[1:]] + [next_bonus]


def generate(
    target,
    drafter,
    prompt_ids: list[int],
    cfg: GenerationConfig,
    *,
    max_len: int | None = None,
    on_tokens: Callable[[list[int]], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> GenerationResult:
    """Generate up to cfg.max_new_tokens after prompt_ids; max_len bounds the KV cache (tokens).

    The default max_len leaves room for a full draft on top of the longest output, so only
    max_new_tokens (never the cache) shrinks the last rounds' drafts.
    """
    _check(cfg, drafter)
    max_len = max_len or len(prompt_ids) + cfg.max_new_tokens + _draft_width(cfg, drafter)
    if not 0 < len(prompt_ids) <= max_len:
        raise ValueError(f"prompt of {len(prompt_ids)} tokens does not fit max_len {max_len}")
    started = time.perf_counter()
    seq = _Sequence(target, drafter, cfg, max_len)
    out = _Output(cfg, on_tokens)
    acceptance: list[int] = []
    rounds: list[dict] | None = [] if cfg.trace else None

    out.add([seq.prefill(prompt_ids)])
    ttft = time.perf_counter() - started
    while out.finish_reason is None:
        if should_stop is not None and should_stop():
            out.finish_reason = "cancelled"
            break
        node_room = max_len - seq.cache.length - 1  # the bonus takes one slot
        if node_room < 0:
            out.finish_reason = "length"
            break
        tree = seq.propose(depth_room=out.remaining - 1, node_room=node_room)  # -1: next bonus
        accepted, new_tokens = seq.commit(tree, *seq.verify(tree))
        acceptance.append(out.add(new_tokens))
        if rounds is not None:
            rounds.append(_trace(tree, accepted))

    decode_seconds = time.perf_counter() - started - ttft
    decoded = len(out.ids) - 1
    return GenerationResult(
        output_ids=out.ids,
        finish_reason=out.finish_reason,
        acceptance_lengths=acceptance,
        stage_seconds=seq.clock.seconds,
        decode_tokens_per_s=decoded / decode_seconds if decoded and decode_seconds > 0 else 0.0,
        ttft_s=ttft,
        rounds=rounds,
    )


def _draft_width(cfg: GenerationConfig, drafter) -> int:
    """The most draft nodes one round verifies."""
    if cfg.method == "ar":
        return 0
    return drafter.block_size - 1 if cfg.method == "linear" else cfg.budget


def _shape_draft(cfg: GenerationConfig, logits: torch.Tensor, depth_room: int, node_room: int):
    """The round's draft from logits [B-1, V]: a chain or a DDTree within the rooms left."""
    depth = min(logits.shape[0], depth_room, node_room)
    if cfg.method == "linear":
        return chain_tree(logits[:depth].argmax(dim=-1).cpu().numpy())
    log_probs, token_ids = top_k_log_probs(logits[:depth], cfg.budget)
    return build_tree(log_probs, token_ids, min(cfg.budget, node_room))


def _trace(tree: DraftTree, accepted: list[int]) -> dict:
    return {
        "tree": {"tokens": tree.tokens.tolist(), "parents": tree.parents.tolist()},
        "accepted": accepted[1:],
    }
