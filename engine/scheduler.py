"""The scheduler: many sequences decoding at once (continuous batching), one target pass a step.

    scheduler = Scheduler(target, drafter, CachePool.for_server(...).slots(max_num_seqs))
    scheduler.add(Request(prompt_ids, cfg, on_tokens=..., should_stop=..., on_finish=...))
    while not scheduler.idle:
        scheduler.step()

A `Request` waits (first come, first served) until a cache slot is free (`max_num_seqs` slots,
each a block table of the server's context over the `CachePool`'s KV block pools, which they
share with one prefix cache, engine/kv_blocks.py). Each `step`:
  admit   waiting requests into free slots; each resumes from the prefix cache (engine/decode.py
          `_Sequence.begin_prefill`);
  plan    for every decoding sequence its round's draft (the drafter, per sequence) and verify
          tokens (its tree, a chain, or one token for `ar`); the rest of `max_num_batched_tokens`
          is shared among the prefilling sequences in arrival order (each a piece of its next
          chunk: a long prompt never stalls the others, and a short one arriving behind it gets
          its share of the next pass at once);
  pass    one `target.forward_batch` over every segment (engine/models/common.py `Segment`);
  commit  each decoding sequence walks its tree with the target's choices (its own grammar,
          penalties and generator), each prefill piece is kept; tokens are emitted;
  retire  finished, stopped or cancelled sequences store what they committed in the prefix
          cache, free their slot and report `on_finish`.
A sequence's tokens are the target's own choices along its own path, so they equal its solo
`generate()` whatever runs beside it (tests/engine/test_batching.py, float64).

A step that raises fails the sequences it ran (`Finished.error`), the others keep going; one that
ran out of memory empties the prefix cache first and puts those that had emitted nothing back at
the head of the queue once (a request that fits without the cache never fails because of it).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np
import torch

from engine.budgets import Acceptance, Baseline, Budgets
from engine.cache_pool import CachePool
from engine.decode import (
    GenerationConfig,
    GenerationResult,
    Run,
    _check,
    _draft_width,
    _Sequence,
)
from engine.memory_plan import is_out_of_memory
from engine.models.common import Segment
from engine.sampling import TokenLogprob
from engine.tree import DraftTree, chain_tree

log = logging.getLogger(__name__)

DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048  # vLLM's name; tokens of one target pass at most


@dataclass(frozen=True)
class Finished:
    """How a request ended: its result (None: cancelled before its first token), or the error
    that failed it; `admitted`: when it left the queue (time.monotonic)."""

    result: GenerationResult | None
    error: BaseException | None = None
    admitted: float | None = None


def _ignore(_: Finished) -> None:
    return None


@dataclass
class Request:
    prompt_ids: list[int]
    cfg: GenerationConfig
    on_tokens: Callable[[list[int]], None] | None = None
    should_stop: Callable[[], bool] | None = None  # polled once a step
    on_logprobs: Callable[[list[TokenLogprob]], None] | None = None  # before on_tokens
    on_finish: Callable[[Finished], None] = _ignore
    retried: bool = False  # put back once after running out of memory


@dataclass(eq=False)  # one running request: compared by identity
class _Active:
    """A running request: its sequence in its slot, and its run once the prefill chose."""

    request: Request
    seq: _Sequence
    pool: CachePool
    run: Run
    admitted: float
    prefilling: bool = True
    acceptance: Acceptance | None = None  # auto: what its budgets are chosen from


@dataclass
class _Work:
    """One sequence's share of a step: a prefill piece, or a round's tree."""

    active: _Active
    segment: Segment
    tree: DraftTree | None = None  # None: a prefill piece


class Scheduler:
    """Runs requests in the slots of `pools` (one sequence each), a batched pass per step."""

    def __init__(
        self,
        target,
        drafter,
        pools: list[CachePool],
        max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
        options: dict | None = None,
    ) -> None:
        if not pools or max_num_batched_tokens < 1:
            raise ValueError("a scheduler needs at least one slot and one token a pass")
        self.target, self.drafter = target, drafter
        self.free = list(pools)
        self.max_num_seqs, self.slot_len = len(pools), pools[0].max_len
        self.prefix_cache = pools[0].prefix_cache  # shared by every slot
        self.max_num_batched_tokens = max_num_batched_tokens
        self.options = options or {}  # GenerationConfig fields every request gets
        self.waiting: deque[Request] = deque()
        self.running: list[_Active] = []
        self.passes = 0  # target passes run so far
        self.budgets = Budgets(target.embed_tokens.weight.device.type)  # auto's cost model
        self.on_pass: Callable[[int, int], None] | None = None  # (sequences, tokens) of a pass

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    @property
    def room(self) -> int:
        """How many more requests `add` can take now without one waiting for a slot."""
        return len(self.free) - len(self.waiting)

    @property
    def counts(self) -> tuple[int, int]:
        """(running, waiting) requests."""
        return len(self.running), len(self.waiting)

    def add(self, request: Request) -> None:
        """Queue a request (its config checked now: a bad one finishes at once with the error)."""
        request.cfg = replace(request.cfg, **self.options)
        try:
            _check(request.cfg, self.drafter)
            self._max_len(request)
        except ValueError as error:
            request.on_finish(Finished(None, error))
            return
        self.waiting.append(request)

    def step(self) -> None:
        """Admit, plan, run one pass, commit, retire (see the module docstring)."""
        self._admit()
        if (alone := self._decoding_alone()) is not None:
            self._solo_round(alone)
        elif work := self._plan():
            try:
                self._pass(work)
            except Exception as error:  # the pass's sequences fail, the others keep going
                self._fail([item.active for item in work if item.active in self.running], error)
        self._retire()

    def cancel_all(self) -> None:
        """Stop every request now: the waiting ones finish cancelled, the running ones too."""
        while self.waiting:
            self.waiting.popleft().on_finish(Finished(None))
        for active in list(self.running):
            active.run.out.finish_reason = active.run.out.finish_reason or "cancelled"
        self._retire()

    # -- the step's parts --------------------------------------------------------------------

    def _max_len(self, request: Request) -> int:
        """The request's KV room (as `generate` sizes it, within a slot); ValueError if its
        prompt does not fit."""
        cfg = request.cfg
        wanted = len(request.prompt_ids) + cfg.max_new_tokens + _draft_width(cfg, self.drafter)
        max_len = min(wanted, self.slot_len)
        if not 0 < len(request.prompt_ids) <= max_len:
            raise ValueError(
                f"prompt of {len(request.prompt_ids)} tokens does not fit max_len {max_len}"
            )
        return max_len

    def _admit(self) -> None:
        """Waiting requests into free slots, first come first served."""
        while self.waiting and self.free:
            request = self.waiting.popleft()
            if request.should_stop is not None and request.should_stop():
                request.on_finish(Finished(None))
                continue
            pool = self.free.pop(0)
            try:
                seq = _Sequence(self.target, self.drafter, request.cfg, pool)
            except Exception as error:
                self.free.insert(0, pool)
                request.on_finish(Finished(None, error))
                continue
            run = Run(
                seq,
                self._max_len(request),
                time.perf_counter(),
                request.on_tokens,
                request.on_logprobs,
            )
            active = _Active(request, seq, pool, run, time.monotonic())
            if request.cfg.method == "auto":
                active.acceptance = Acceptance(request.cfg.budget)
            self.running.append(active)
            try:
                seq.begin_prefill(request.prompt_ids)
            except Exception as error:
                self._fail([active], error)

    def _plan(self) -> list[_Work]:
        """This step's work: every decoding sequence's round, then prefill pieces within the
        token budget left. A sequence whose own part raises (its draft) fails alone."""
        work = self._rounds([active for active in self.running if not active.prefilling])
        budget = self.max_num_batched_tokens - sum(item.segment.ids.shape[0] for item in work)
        prefilling = [active for active in self.running if active.prefilling]
        for index, active in enumerate(prefilling):
            share = budget // (len(prefilling) - index)
            try:
                item = self._prefill_piece(active, share)
            except Exception as error:
                self._fail([active], error)
                continue
            if item is not None:
                work.append(item)
                budget -= item.segment.ids.shape[0]
        return work

    def _decoding_alone(self) -> _Active | None:
        """The running sequence when it is the only one and decodes (nothing prefills beside
        it) with a method of its own: its round then runs as `generate` runs it
        (`_solo_round`). An `auto` one keeps the batched pass, where its budgets are chosen."""
        if len(self.running) != 1:
            return None
        active = self.running[0]
        return None if active.prefilling or active.acceptance is not None else active

    def _solo_round(self, active: _Active) -> None:
        """One round of a sequence decoding alone, by `generate`'s steps: its static passes
        (the drafter's context and block in one pass, a fixed-width verify; CUDA graphs on a
        GPU) instead of a batched pass of one segment, which costs a batch-1 ddtree round ~20%
        more host work (aten ops) on the demo pair. The tokens are the target's choices either
        way, so a sequence may switch between the two from one round to the next."""
        run, seq = active.run, active.seq
        try:
            tree = run.next_tree(active.request.should_stop)
            if tree is None:  # finished: retired by the step
                return
            run.committed(tree, *seq.commit(tree, *seq.verify(tree), run.out.taking))
        except Exception as error:
            self._fail([active], error)
            return
        self.passes += 1
        if self.on_pass is not None:
            self.on_pass(1, tree.size + 1)

    def _rounds(self, decoding: list[_Active]) -> list[_Work]:
        """Each decoding sequence's round as its verify segment: the drafts of all that draft
        in one drafter pass (engine/models/dflash.py `draft_batch`). One that finished adds
        none; a failed draft fails the sequences it drafted for."""
        rounds, drafting = [], []
        for active in decoding:
            rooms = active.run.next_rooms(active.request.should_stop)
            if rooms is None:
                continue
            rounds.append((active, rooms))
            if active.seq.start_round(*rooms):
                drafting.append(active)
        drafting = self._auto_drafting(rounds, drafting)
        trees = {}
        if drafting:
            started = time.perf_counter()
            try:
                drafts = self._draft(drafting)
            except Exception as error:
                self._fail(drafting, error)
                rounds = [(active, rooms) for active, rooms in rounds if active not in drafting]
            else:
                room = {id(active): rooms for active, rooms in rounds}
                for active, draft in zip(drafting, drafts, strict=True):
                    trees[id(active)] = active.seq.shape(draft, *room[id(active)])
                seconds = time.perf_counter() - started  # on CUDA: shape read the drafts back
                self.budgets.observe_draft(len(drafting), seconds)
                self._auto_nodes(rounds, trees, seconds)
        work = []
        for active, _ in rounds:
            seq = active.seq
            tree = trees.get(id(active), chain_tree(np.zeros(0, np.int64)))
            ids, parents = seq.verify_inputs(tree)
            work.append(_Work(active, Segment(ids, seq.cache, parents), tree))
        return work

    def _auto_drafting(self, rounds: list, drafting: list[_Active]) -> list[_Active]:
        """`drafting` less the auto sequences whose draft would not pay this step (a round of
        their bonus alone instead: engine/budgets.py)."""
        auto = [active for active in drafting if active.acceptance is not None]
        if not auto:
            return drafting
        base = self._baseline(rounds, {})
        rooms = {id(active): node_room for active, (_, node_room) in rounds}
        asked = [(active.acceptance, rooms[id(active)]) for active in auto]
        drafts = dict(zip(map(id, auto), self.budgets.drafting(asked, base), strict=True))
        for active in auto:
            active.acceptance.skipped += not drafts[id(active)]
        return [active for active in drafting if drafts.get(id(active), True)]

    def _auto_nodes(self, rounds: list, trees: dict, draft_seconds: float) -> None:
        """Each drafted auto sequence's tree cut to the nodes chosen for this step."""
        auto = [active for active, _ in rounds if active.acceptance is not None]
        auto = [active for active in auto if id(active) in trees]
        if not auto:
            return
        base = self._baseline(rounds, trees)
        for active in auto:
            active.acceptance.drafted(trees[id(active)].log_probs)
        asked = [(active.acceptance, trees[id(active)].log_probs) for active in auto]
        counts = self.budgets.nodes(asked, base, draft_seconds)
        for active, count in zip(auto, counts, strict=True):
            trees[id(active)] = active.seq.trim(trees[id(active)], count)

    def _baseline(self, rounds: list, trees: dict) -> Baseline:
        """This step's rounds beside the auto sequences (each counted as its bonus alone):
        another's tokens are its tree's (before the draft: its widest), its gain its mean
        tokens a round so far. Prefill pieces are left out (they fill what the rounds leave)."""
        tokens, trees_in, gain = 0, 0, 0.0
        for active, rooms in rounds:
            if active.acceptance is not None:
                tokens, gain = tokens + 1, gain + 1
                continue
            tree = trees.get(id(active))
            nodes = tree.size if tree is not None else min(active.seq.width - 1, *rooms)
            tokens, trees_in = tokens + 1 + nodes, trees_in + (nodes > 0)
            gain += statistics.fmean(active.run.acceptance) if active.run.acceptance else 1.0
        return Baseline(tokens, trees_in, gain)

    def _draft(self, drafting: list[_Active]) -> list[torch.Tensor]:
        """The drafter's logits [B-1, V] after each sequence's bonus, from one batched pass."""
        items = [(a.seq.draft_cache, a.seq.context, a.seq.bonus) for a in drafting]
        drafts = self.drafter.draft_batch(self.target, items)
        for active in drafting:
            active.seq.context = None
        return drafts

    def _prefill_piece(self, active: _Active, share: int) -> _Work | None:
        """Up to `share` more prompt tokens of a prefilling sequence, as a segment (None: none
        this step, or the prompt was all cached, or scored on its own)."""
        seq = active.seq
        if active.request.should_stop is not None and active.request.should_stop():
            active.run.out.finish_reason = "cancelled"
            return None
        piece = seq.next_piece(limit=share) if share > 0 else None
        if piece is not None and seq.prompt_scores is not None:  # prompt logprobs: scored in
            seq.piece_done(piece.shape[0], *seq._extend(piece, seq.prefilled))  # its own extend
            piece = None
        if piece is None:
            if seq.prefill_left == 0:
                self._prefilled(active)
            return None
        return _Work(active, Segment(piece, seq.cache, extend=True))

    def _pass(self, work: list[_Work]) -> None:
        """One target pass over the work, then each sequence's commit."""
        layers = tuple(self.drafter.target_layer_ids) if self.drafter is not None else ()
        wanted = layers if any(item.active.seq.speculative for item in work) else ()
        started = time.perf_counter()
        outputs = self.target.forward_batch([item.segment for item in work], wanted)
        self.passes += 1
        tokens = sum(item.segment.ids.shape[0] for item in work)
        if self.on_pass is not None:
            self.on_pass(len(work), tokens)
        for item, (logits, hidden) in zip(work, outputs, strict=True):
            seq, hidden = item.active.seq, hidden if item.active.seq.speculative else None
            if item.tree is None:
                seq.piece_done(item.segment.ids.shape[0], logits, hidden)
                if seq.prefill_left == 0:
                    self._prefilled(item.active)
                continue
            choices, seq.scores = seq._choose(logits, item.tree)
            accepted, new_tokens = seq.commit(
                item.tree, choices, hidden, None, item.active.run.out.taking
            )
            item.active.run.committed(item.tree, accepted, new_tokens)
            if item.active.acceptance is not None and item.tree.size:
                item.active.acceptance.verified_round(item.tree.log_probs, len(accepted) - 1)
        trees = sum(item.segment.ids.shape[0] > 1 for item in work)
        self.budgets.observe_pass(tokens, trees, time.perf_counter() - started)  # choices read

    def _prefilled(self, active: _Active) -> None:
        active.prefilling = False
        active.run.prefilled(active.seq.end_prefill())

    def _retire(self) -> None:
        for active in [a for a in self.running if a.run.out.finish_reason is not None]:
            self.running.remove(active)
            try:
                if active.prefilling:  # cancelled before its first token
                    active.seq.caches.abandon()
                    finished = Finished(None, admitted=active.admitted)
                else:
                    active.seq.finish()
                    finished = Finished(active.run.result(), admitted=active.admitted)
            except Exception as error:
                active.seq.caches.abandon()
                finished = Finished(None, error, active.admitted)
            self.free.append(active.pool)
            active.request.on_finish(finished)

    def _fail(self, failed: list[_Active], error: Exception) -> None:
        """The step that ran `failed` raised `error`: their slots are freed; after running out
        of memory the prefix cache is emptied and those that emitted nothing are queued again
        (once), the rest fail."""
        retry = is_out_of_memory(error) and self._empty_prefix_cache()
        for active in reversed(failed):
            self.running.remove(active)
            active.seq.caches.abandon()
            self.free.append(active.pool)
            request = active.request
            if retry and not request.retried and not active.run.out.ids:
                request.retried = True
                self.waiting.appendleft(request)
                continue
            log.warning("generation failed: %s: %s", type(error).__name__, error)
            request.on_finish(Finished(None, error, active.admitted))

    def _empty_prefix_cache(self) -> bool:
        cache = self.prefix_cache
        if cache is None or not cache.used_bytes:
            return False
        log.warning("out of memory with %d bytes in the prefix cache: emptied", cache.used_bytes)
        cache.clear()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return True


class GenerateFn(Protocol):
    """`engine.decode.generate` with its models bound (engine/server/app.py's load_engine)."""

    def __call__(
        self,
        prompt_ids: list[int],
        cfg: GenerationConfig,
        *,
        on_tokens: Callable[[list[int]], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
        on_logprobs: Callable[[list[TokenLogprob]], None] | None = None,
    ) -> GenerationResult: ...


class EngineLoop(Protocol):
    """What the server's worker drives: a `Scheduler`, or a `SerialLoop`."""

    on_pass: Callable[[int, int], None] | None

    @property
    def idle(self) -> bool: ...
    @property
    def room(self) -> int: ...
    @property
    def counts(self) -> tuple[int, int]: ...
    def add(self, request: Request) -> None: ...
    def step(self) -> None: ...
    def cancel_all(self) -> None: ...


class SerialLoop:
    """One request at a time, each step a whole `generate` call: the engine over several
    tensor-parallel ranks (engine/parallel.py runs one sequence), or a scripted one in tests."""

    def __init__(self, generate: GenerateFn) -> None:
        self.generate = generate
        self.waiting: deque[Request] = deque()
        self.on_pass: Callable[[int, int], None] | None = None  # no passes to report
        self._running = 0

    @property
    def idle(self) -> bool:
        return not self.waiting

    @property
    def room(self) -> int:
        return 0 if self.waiting else 1

    @property
    def counts(self) -> tuple[int, int]:
        return self._running, len(self.waiting) - self._running

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def step(self) -> None:
        request = self.waiting[0]
        admitted, self._running = time.monotonic(), 1
        callbacks = {"on_tokens": request.on_tokens, "should_stop": request.should_stop}
        if request.on_logprobs is not None:
            callbacks["on_logprobs"] = request.on_logprobs
        try:
            result = self.generate(request.prompt_ids, request.cfg, **callbacks)
        except Exception as error:  # one failed generation must not end the loop
            finished = Finished(None, error, admitted)
        else:
            finished = Finished(result, admitted=admitted)
        finally:
            self.waiting.popleft()
            self._running = 0
        request.on_finish(finished)

    def cancel_all(self) -> None:
        while self.waiting:
            self.waiting.popleft().on_finish(Finished(None))
