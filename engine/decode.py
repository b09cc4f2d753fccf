"""One round loop for autoregressive (`ar`), DFlash chain (`linear`) and DDTree (`ddtree`) decoding.

Each round, with `bonus` the target's latest choice (already output, not yet in the KV cache):
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
    device = target.embed_tokens.weight.device
    speculative = cfg.method != "ar"
    layers = tuple(drafter.target_layer_ids) if speculative else ()
    generator = make_generator(device, cfg.seed) if cfg.temperature > 0 else None
    clock = _StageClock(device)
    out = _Output(cfg, on_tokens)
    acceptance: list[int] = []
    rounds: list[dict] | None = [] if cfg.trace else None
    started = time.perf_counter()

    cache = target.new_cache(max_len)
    draft_cache = drafter.new_cache(max_len) if speculative else None
    with clock.stage("prefill"):
        prompt = torch.tensor(prompt_ids, dtype=torch.long, device=device)
        logits, context = target.forward(prompt, cache, hidden_layers=layers)
        target.commit(cache, torch.arange(len(prompt_ids), device=device))
        bonus = int(choose(logits[-1:], cfg.temperature, generator)[0])
    ttft = time.perf_counter() - started
    out.add([bonus])

    while out.finish_reason is None:
        if should_stop is not None and should_stop():
            out.finish_reason = "cancelled"
            break
        node_room = max_len - cache.length - 1  # the bonus takes one slot
        if node_room < 0:
            out.finish_reason = "length"
            break
        depth_room = out.remaining - 1  # the round's own bonus is one more output token
        tree = chain_tree(np.zeros(0, np.int64))
        if speculative and min(depth_room, node_room) > 0:
            with clock.stage("draft"):
                logits = drafter.draft(target, draft_cache, context, bonus)  # [B-1, V]
            with clock.stage("tree"):
                tree = _shape_draft(cfg, logits, depth_room, node_room)
            context = None
        with clock.stage("verify"):
            ids = torch.tensor([bonus, *tree.tokens.tolist()], dtype=torch.long, device=device)
            parents = torch.from_numpy(tree.verify_parents()) if cfg.method == "ddtree" else None
            logits, hidden = target.forward(ids, cache, parents, layers)
            choices = choose(logits, cfg.temperature, generator).tolist()
        with clock.stage("commit"):
            accepted, next_bonus = walk(tree, choices)
            path = torch.tensor(accepted, dtype=torch.long, device=device)
            target.commit(cache, path)
            if speculative:
                fresh = hidden[path]  # [K, n*H] features of the newly committed tokens
                context = fresh if context is None else torch.cat([context, fresh])
        new_tokens = [int(tree.tokens[i - 1]) for i in accepted[1:]] + [next_bonus]
        acceptance.append(out.add(new_tokens))
        if rounds is not None:
            rounds.append(_trace(tree, accepted))
        bonus = next_bonus

    decode_seconds = time.perf_counter() - started - ttft
    decoded = len(out.ids) - 1
    return GenerationResult(
        output_ids=out.ids,
        finish_reason=out.finish_reason,
        acceptance_lengths=acceptance,
        stage_seconds=clock.seconds,
        decode_tokens_per_s=decoded / decode_seconds if decoded and decode_seconds > 0 else 0.0,
        ttft_s=ttft,
        rounds=rounds,
    )


def _draft_width(cfg: GenerationConfig, drafter) -> int:
    """The most draft nodes one round verifies."""
    return (
        {"ar": 0, "linear": drafter.block_size - 1, "ddtree": cfg.budget}[cfg.method]
        if drafter
        else 0
    )


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
