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
  plan    for every decoding sequence whether it drafts (`auto`: engine/budgets.py), its round's
          draft (one drafter pass for all) and verify tokens (its tree, a chain, or one token
          for `ar` or a round without a draft); the rest of `max_num_batched_tokens`
          is shared among the prefilling sequences in arrival order (each a piece of its next
          chunk: a long prompt never stalls the others, and a short one arriving behind it gets
          its share of the next pass at once);
  pass    one `target.forward_batch` over every segment (engine/models/common.py `Segment`);
          on CUDA a plain step (every round its bonus alone: `ar`, `auto` not drafting) or a
          tree step (verify rounds alone) replays its bucket's captured graph instead
          (engine/step_passes.py, engine/tree_passes.py), and so do the drafts
          (engine/draft_passes.py);
  commit  each decoding sequence walks its tree with the target's choices (its own grammar,
          penalties and generator), each prefill piece is kept; tokens are emitted;
  retire  finished, stopped or cancelled sequences store what they committed in the prefix
          cache, free their slot and report `on_finish`.
A sequence's tokens are the target's own choices along its own path, so they equal its solo
`generate()` whatever runs beside it (tests/engine/test_batching.py, float64).

Preemption (vLLM's rule): the slots share one KV block pool that may hold fewer blocks than
`max_num_seqs` full sequences (`CachePool.slots(count, kv_tokens)`). Before a step runs anything,
every running sequence's work takes its blocks, oldest first (a round's verify tokens, and its
draft's context and block if it drafts; a prefill piece); while the pool has none left (the prefix
cache gives back its least recently used first), the most recently admitted running sequence is
preempted: its blocks, its slot (GDN states) and its drafter features are given back, what it
committed is stored in the prefix cache, and it goes back to the head of the queue with its tokens,
output and sampling state (generator, penalties, grammar). Readmitted, it re-prefills what it had
committed (from the longest prefix the prefix cache still holds) and its next round continues where
it stopped: no token is streamed twice or lost. A waiting request is admitted only once the blocks
of its first prefill piece are free, so an oversubscribed pool queues rather than thrashes.
`preemptions` counts them (`on_preempt`: the server's /metrics).

A step that raises fails the sequences it ran (`Finished.error`), the others keep going; one that
ran out of memory empties the prefix cache first and puts those that had emitted nothing back at
the head of the queue once (a request that fits without the cache never fails because of it).
A sequence that does not fit the pool even alone fails with the pool's out-of-memory error.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
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
from engine.draft_passes import DraftPasses
from engine.kv_blocks import PoolExhausted
from engine.memory_plan import is_out_of_memory
from engine.methods import TREE_METHODS
from engine.models.common import BatchOutputs, Segment
from engine.sampling import TokenLogprob, read_scored_together
from engine.step_passes import StepPasses
from engine.transfer import to_device
from engine.tree import DraftTree, TopK, chain_tree, top_k_log_probs
from engine.tree_passes import TreePasses

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
    prefilling: bool = True  # its prompt, or after a preemption what it had committed
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
        self.steps = _step_passes(target, pools[0], self.options.get("cuda_graphs", True))
        most, memory = len(pools), self.steps.memory if self.steps else None
        self.trees = TreePasses(target, True, memory, most) if self.steps else None
        self.drafts = _draft_passes(drafter, target, pools[0], self.steps, most)
        if len(pools) > 1:  # a solo round's captured graphs would be per slot: see _solo_round
            self.options = {**self.options, "cuda_graphs": False}
        self.waiting: deque[Request | _Active] = deque()  # _Active: preempted, at the head
        self.running: list[_Active] = []  # in the order they were admitted
        self.passes = 0  # target passes run so far
        self.preemptions = 0
        self.resumed = {"recomputed": 0, "cached": 0}  # the preempted's tokens, readmitted
        self.budgets = Budgets(target.embed_tokens.weight.device.type)  # auto's cost model
        self.on_pass: Callable[[int, int], None] | None = None  # (sequences, tokens) of a pass
        self._step_started = 0.0
        # a lone auto sequence's last round: timed from its step's start to the next step's
        # (`_time_lone_round`): (the sequence, what its seconds tell the budgets, the start)
        self._lone_round: tuple[_Active, Callable[[float], None], float] | None = None
        self.on_preempt: Callable[[], None] | None = None  # a sequence was preempted

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
        self._step_started = time.perf_counter()
        self._time_lone_round()
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
            self._drop_waiting(self.waiting.popleft())
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
        """Waiting requests (preempted sequences first, at the head) into free slots, first
        come first served, each only once the pool holds the blocks of its first prefill
        piece: else it waits at the head for blocks to come back (or fails, when nothing runs
        that could give them back)."""
        while self.waiting and self.free:
            item = self.waiting.popleft()
            request = item.request if isinstance(item, _Active) else item
            if request.should_stop is not None and request.should_stop():
                self._drop_waiting(item)
                continue
            pool = self.free.pop(0)
            try:
                active = self._start(item, pool)
            except Exception as error:
                self.free.insert(0, pool)
                request.on_finish(Finished(None, error))
                continue
            self.running.append(active)
            try:
                if not self._hold(active, partial(self._hold_first_piece, active), preempt=False):
                    break
            except Exception as error:
                self._fail([active], error)

    def _start(self, item: Request | _Active, pool: CachePool) -> _Active:
        """A waiting request's sequence in `pool`, its prefill begun; or a preempted one's,
        its re-prefill begun."""
        if isinstance(item, _Active):
            item.pool, item.prefilling = pool, True
            item.seq.restart(pool)
            if item.seq.resuming:
                left, total = item.seq.prefill_left, len(item.seq.committed)
                self.resumed["recomputed"] += left
                self.resumed["cached"] += total - left
                log.info(
                    "resumed a preempted sequence: %d of its %d tokens cached", total - left, total
                )
            return item
        seq = _Sequence(self.target, self.drafter, item.cfg, pool)
        run = Run(seq, self._max_len(item), time.perf_counter(), item.on_tokens, item.on_logprobs)
        try:
            seq.begin_prefill(item.prompt_ids)
        except Exception:
            seq.caches.abandon()
            raise
        active = _Active(item, seq, pool, run, time.monotonic())
        # A seeded sampled request must repeat its tokens, and how many nodes a round verifies
        # changes its generator's draws: it verifies its cap every round, as ddtree.
        seeded = item.cfg.temperature > 0 and item.cfg.seed is not None
        if item.cfg.method == "auto" and not seeded:
            joining = min(self.max_num_seqs, len(self.running) + len(self.waiting) + 1)
            active.acceptance = self.budgets.new_sequence(item.cfg.budget, joining)
        return active

    def _hold_first_piece(self, active: _Active) -> None:
        piece = active.seq.next_piece(limit=self.max_num_batched_tokens)
        if piece is not None:
            active.seq.cache.check_room(piece.shape[0])

    def _drop_waiting(self, item: Request | _Active) -> None:
        """A waiting request cancelled (or cut); a preempted one ends with what it streamed."""
        if not isinstance(item, _Active):
            item.on_finish(Finished(None))
            return
        result = None
        if item.run.out.ids:
            item.run.out.finish_reason = item.run.out.finish_reason or "cancelled"
            result = item.run.result()
        item.request.on_finish(Finished(result, admitted=item.admitted))

    def _plan(self) -> list[_Work]:
        """This step's work: every decoding sequence's round, then prefill pieces within the
        token budget left, once each holds its blocks, oldest first (`_hold`: preempting when
        the pool is short). A sequence whose own part raises (its draft) fails alone."""
        rounds = []
        for active in self.running:
            if not active.prefilling:
                rooms = active.run.next_rooms(active.request.should_stop)
                if rooms is not None:
                    rounds.append((active, rooms))
        draft_ids = self._drafting(rounds)
        tokens = sum(_round_tokens(a, rooms, id(a) in draft_ids) for a, rooms in rounds)
        pieces = self._pieces(self.max_num_batched_tokens - tokens)
        holds = {
            id(a): partial(self._hold_round, a, rooms, id(a) in draft_ids) for a, rooms in rounds
        }
        holds.update((id(a), partial(a.seq.cache.check_room, p.shape[0])) for a, p in pieces)
        for active in list(self.running):
            if id(active) in holds and active in self.running:
                try:
                    self._hold(active, holds[id(active)])
                except Exception as error:
                    self._fail([active], error)
        work = self._rounds([(a, rooms) for a, rooms in rounds if a in self.running], draft_ids)
        for active, piece in pieces:
            if active in self.running and (item := self._piece_work(active, piece)) is not None:
                work.append(item)
        return work

    def _hold(self, active: _Active, hold: Callable[[], None], preempt: bool = True) -> bool:
        """Run `hold` (it takes the blocks of `active`'s next work); while the pool has none
        left, preempt the most recently admitted running sequence and try again (`preempt`
        False: put `active` back at the head of the queue instead, a request being admitted).
        False when `active` itself went back; PoolExhausted when it runs alone and still
        does not fit."""
        while True:
            try:
                hold()
                return True
            except PoolExhausted:
                if len(self.running) == 1:
                    raise
                victim = self.running[-1] if preempt else active
                self._requeue(victim, counted=preempt)
                if victim is active:
                    return False

    def _hold_round(self, active: _Active, rooms: tuple[int, int], drafts: bool) -> None:
        """The blocks of a round: its verify tokens, and if it `drafts`, its draft's context
        and block."""
        seq = active.seq
        seq.cache.check_room(_round_tokens(active, rooms, drafts))
        if drafts:
            cache, rows = seq.draft_cache, seq.context_rows
            cache.check_room(min(rows + self.drafter.block_size, cache.max_len - cache.length))

    def _requeue(self, active: _Active, counted: bool) -> None:
        """`active` leaves the running, its caches given back, for the head of the queue
        (`counted`: a preemption, logged and counted)."""
        self.running.remove(active)
        active.seq.preempt()
        self.free.append(active.pool)
        self.waiting.appendleft(active)
        if not counted:
            return
        self.preemptions += 1
        log.info(
            "preempted a sequence (%d tokens committed, %d streamed): the KV block pool is "
            "full; %d running, %d waiting, %d preemptions so far",
            len(active.seq.committed),
            len(active.run.out.ids),
            len(self.running),
            len(self.waiting),
            self.preemptions,
        )
        if self.on_preempt is not None:
            self.on_preempt()

    def _decoding_alone(self) -> _Active | None:
        """The running sequence when it is the only one and decodes (nothing prefills beside
        it), drafts or replays captured graphs: its round then runs as `generate` runs it
        (`_solo_round`). An `auto` one does when its budgets say it drafts this round; its tree
        is then verified whole (the static verify's width is fixed: fewer nodes would cost as
        much). A round of its bonus alone keeps the batched pass, and so does an eager `ar`
        one: there its one-token step is cheaper (541.7 aten ops a step on the demo pair
        against the static pass's 594.4, the hybrid's GDN single step)."""
        if len(self.running) != 1:
            return None
        active = self.running[0]
        if active.prefilling:
            return None
        if active.acceptance is not None:
            rooms = active.run.next_rooms(active.request.should_stop)
            drafts = (
                rooms is not None and min(rooms) > 0 and all(self._auto_drafts([(active, rooms)]))
            )
            return active if drafts else None
        return active if active.seq.speculative or active.seq.graphs else None

    def _solo_round(self, active: _Active) -> None:
        """One round of a sequence decoding alone, by `generate`'s steps: its static passes
        (the drafter's context and block in one pass, a fixed-width verify; CUDA graphs on a
        GPU) instead of a batched pass of one segment, which costs a batch-1 ddtree round ~20%
        more host work (aten ops) on the demo pair. The tokens are the target's choices either
        way, so a sequence may switch between the two from one round to the next. CUDA graphs
        only in a scheduler of one slot (generate()'s, before the scheduler): a captured graph
        keeps its activations for the server's life, and a set per slot is not in the memory
        plan (engine/memory_plan.py), so with several slots the static passes run eagerly."""
        run, seq = active.run, active.seq
        try:
            tree = run.next_tree(active.request.should_stop)
            if tree is None:  # finished: retired by the step
                return
            accepted, new_tokens = seq.commit(tree, *seq.verify(tree), run.out.taking)
            run.committed(tree, accepted, new_tokens)
        except Exception as error:
            self._fail([active], error)
            return
        if active.acceptance is not None:
            self._solo_auto_round(active, tree, len(accepted) - 1)
        self.passes += 1
        if self.on_pass is not None:
            self.on_pass(1, tree.size + 1)

    def _solo_auto_round(self, active: _Active, tree: DraftTree, accepted: int) -> None:
        """What an `auto` sequence's solo round tells its budgets: its tree and acceptance, and
        (eager passes only: a captured graph's first replay is its capture) the round's
        seconds. A probe (a draft after its skipped rounds) that leaves drafting alone not
        paying doubles its wait to the next; a round after which it pays resets it."""
        acceptance = active.acceptance
        probed = acceptance.probe_due
        self.budgets.drafted(acceptance, tree.log_probs)
        self.budgets.verified(acceptance, tree.log_probs, accepted)
        if not active.seq.graphs:
            self._lone_round = (active, self.budgets.observe_solo, self._step_started)
        if (pays := self.budgets.drafting_alone(acceptance)) or probed:
            self.budgets.solo_paid(acceptance, pays)

    def _drafting(self, rounds: list[tuple[_Active, tuple[int, int]]]) -> set[int]:
        """The ids of the rounds' sequences that draft this step: those not `ar` with room for
        a node, less the `auto` ones whose draft would not pay (decided before the step takes
        its blocks: such a round holds its bonus alone)."""
        drafting = [active for active, rooms in rounds if active.seq.may_draft(*rooms)]
        return {id(active) for active in self._auto_drafting(rounds, drafting)}

    def _rounds(
        self, rounds: list[tuple[_Active, tuple[int, int]]], draft_ids: set[int]
    ) -> list[_Work]:
        """Each decoding sequence's round (with its rooms) as its verify segment: the drafts
        of those in `draft_ids` in one drafter pass (engine/models/dflash.py `draft_batch`); a
        failed draft fails the sequences it drafted for."""
        drafting = []
        for active, rooms in rounds:
            if not active.seq.start_round(*rooms):
                continue
            if id(active) in draft_ids:
                drafting.append(active)
            elif active.acceptance is not None:  # an auto round that chose its bonus alone
                active.acceptance.skipped += 1
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
                tops = _tops(drafting, drafts)
                for active, draft in zip(drafting, drafts, strict=True):
                    top = tops.get(id(active))
                    trees[id(active)] = active.seq.shape(draft, *room[id(active)], top)
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
        drafts = dict(zip(map(id, auto), self._auto_drafts(rounds, auto), strict=True))
        return [active for active in drafting if drafts.get(id(active), True)]

    def _auto_drafts(self, rounds: list, auto: list[_Active] | None = None) -> list[bool]:
        """Whether each of the `auto` sequences (default: those of `rounds`) drafts this step
        (alone: by generate()'s static passes, or its bonus alone in a batched pass)."""
        auto = [active for active, _ in rounds] if auto is None else auto
        if len(self.running) == 1 and len(auto) == 1:
            return [self.budgets.drafting_alone(auto[0].acceptance)]
        rooms = {id(active): node_room for active, (_, node_room) in rounds}
        asked = [(active.acceptance, rooms[id(active)]) for active in auto]
        return self.budgets.drafting(asked, self._baseline(rounds, {}))

    def _auto_nodes(self, rounds: list, trees: dict, draft_seconds: float) -> None:
        """Each drafted auto sequence's tree cut to the nodes chosen for this step."""
        auto = [a for a, _ in rounds if a.acceptance is not None and id(a) in trees]
        if not auto:
            return
        base = self._baseline(rounds, trees)
        for active in auto:
            self.budgets.drafted(active.acceptance, trees[id(active)].log_probs)
        asked = [(active.acceptance, trees[id(active)].log_probs) for active in auto]
        counts = self.budgets.nodes(asked, base, draft_seconds)
        for active, count in zip(auto, counts, strict=True):
            trees[id(active)] = active.seq.trim(trees[id(active)], count)

    def _baseline(self, rounds: list, trees: dict) -> Baseline:
        """This step's work beside the auto sequences (each counted as its bonus alone):
        another's tokens are its tree's (before the draft: its widest); the prefill pieces
        filling the token budget the rounds leave, and their sequences, which wait on the
        step as the decoding ones do (six chats sent at once through the server: the first
        to arrive, decoding alone beside the other five's prefills, drafted its tree there,
        a 30 ms step against 23 ms, when only its own sequence was counted)."""
        tokens, trees_in = 0, 0
        for active, rooms in rounds:
            if active.acceptance is not None:
                tokens += 1
                continue
            tree = trees.get(id(active))
            nodes = tree.size if tree is not None else min(active.seq.width - 1, *rooms)
            tokens, trees_in = tokens + 1 + nodes, trees_in + (nodes > 0)
        prefills = [a.seq.prefill_left for a in self.running if a.prefilling and a.seq.prefill_left]
        pieces = min(sum(prefills), max(0, self.max_num_batched_tokens - tokens))
        return Baseline(tokens + pieces, trees_in, len(rounds) + min(len(prefills), pieces))

    def _draft(self, drafting: list[_Active]) -> torch.Tensor:
        """The drafter's logits [n, B-1, V] after each sequence's bonus, from one batched pass
        (by its bucket's static pass where the server has them: engine/draft_passes.py)."""
        items = [(a.seq.draft_cache, a.seq.context, a.seq.bonus) for a in drafting]
        if self.drafts is not None and self.drafts.takes(items):
            drafts = self.drafts.run(items)
        else:
            drafts = self.drafter.draft_batch(self.target, items)
        for active in drafting:
            active.seq.context = None
        return drafts

    def _pieces(self, budget: int) -> list[tuple[_Active, torch.Tensor]]:
        """The prefilling sequences' pieces, `budget` tokens shared in arrival order (one
        cancelled, or whose prompt was all cached, has none)."""
        prefilling = [active for active in self.running if active.prefilling]
        pieces = []
        for index, active in enumerate(prefilling):
            share = budget // (len(prefilling) - index)
            seq = active.seq
            if active.request.should_stop is not None and active.request.should_stop():
                active.run.out.finish_reason = "cancelled"
                continue
            piece = seq.next_piece(limit=share) if share > 0 else None
            if piece is not None:
                pieces.append((active, piece))
                budget -= piece.shape[0]
            elif seq.prefill_left == 0:
                self._prefilled(active)
        return pieces

    def _piece_work(self, active: _Active, piece: torch.Tensor) -> _Work | None:
        """A prefill piece as a segment (None: scored on its own, the prompt's logprobs)."""
        seq = active.seq
        if seq.scoring_prompt:
            try:
                seq.piece_done(piece.shape[0], *seq._extend(piece, seq.prefilled))
            except Exception as error:
                self._fail([active], error)
                return None
            if seq.prefill_left == 0:
                self._prefilled(active)
            return None
        return _Work(active, Segment(piece, seq.cache, extend=True))

    def _pass(self, work: list[_Work]) -> None:
        """One target pass over the work, then each sequence's commit."""
        layers = tuple(self.drafter.target_layer_ids) if self.drafter is not None else ()
        wanted = layers if any(item.active.seq.speculative for item in work) else ()
        started = time.perf_counter()
        outputs = self._forward(work, wanted)
        self.passes += 1
        tokens = sum(item.segment.ids.shape[0] for item in work)
        if self.on_pass is not None:
            self.on_pass(len(work), tokens)
        kept: list[tuple[_Sequence, list[int], int]] = []  # every round's sequence, kept path
        # and its segment's first row in the pass: committed at once after the walks
        rounds = [(index, item) for index, item in enumerate(work) if item.tree is not None]
        chosen = read_scored_together(
            [item.active.seq._scored(outputs.logits[index], item.tree) for index, item in rounds]
        )
        for index, item in enumerate(work):
            if item.tree is not None:
                continue
            seq = item.active.seq  # a prefill piece
            hidden = outputs.features(index) if seq.speculative else None
            seq.piece_done(item.segment.ids.shape[0], outputs.logits[index], hidden)
            if seq.prefill_left == 0:
                self._prefilled(item.active)
        for (index, item), (choices, scores) in zip(rounds, chosen, strict=True):
            seq = item.active.seq
            seq.scores = scores
            start = outputs.rows[index].start
            accepted, new_tokens = seq.commit(
                item.tree,
                choices,
                None,
                None,
                item.active.run.out.taking,
                lambda path, seq=seq, start=start: kept.append((seq, path, start)),
            )
            item.active.run.committed(item.tree, accepted, new_tokens)
            if item.active.acceptance is not None and item.tree.size:
                self.budgets.verified(
                    item.active.acceptance, item.tree.log_probs, len(accepted) - 1
                )
        commit = outputs.commit or self.target.commit_batch
        commit([(seq.cache, path) for seq, path, _ in kept])
        _keep_features(outputs.hidden, kept)
        trees = sum(item.segment.ids.shape[0] > 1 for item in work)
        seconds = time.perf_counter() - started  # the choices were read: the device is done
        self.budgets.observe_pass(tokens, trees, seconds)
        if self._lone_auto_bonus(work):
            self._lone_round = (work[0].active, self.budgets.observe_alone, self._step_started)

    def _time_lone_round(self) -> None:
        """The last step's round of a lone `auto` sequence still running, timed whole: from its
        step's start to this one's, so what a round costs beside its passes (planning it,
        emitting its tokens, the server's work between steps) is counted once a round, drafted
        or not. Timed over their passes alone, a round of the bonus looked ~0.7 ms cheaper
        than it was behind the demo server (2.4 ms against 3.1), and auto at concurrency 1
        stopped drafting where ddtree:15 was 1.19x ar (engine/NOTES.md, session 28)."""
        if self._lone_round is not None:
            active, observe, started = self._lone_round
            self._lone_round = None
            if active in self.running and active.run.out.finish_reason is None:
                observe(self._step_started - started)

    def _forward(self, work: list[_Work], wanted: tuple[int, ...]) -> BatchOutputs:
        """The target pass over the work: a plain step (every round its bonus alone) or a
        tree step (verify rounds alone) by its bucket's static pass where the server has them
        (engine/step_passes.py, engine/tree_passes.py)."""
        segments = [item.segment for item in work]
        if self.steps is not None and self.steps.takes(segments):
            return self.steps.run([item.active.seq.bonus for item in work], segments, wanted)
        if self.trees is not None and self.trees.takes(segments):
            ids = [np.array([item.active.seq.bonus, *item.tree.tokens]) for item in work]
            return self.trees.run(ids, segments, wanted)
        return self.target.forward_batch(segments, wanted)

    def _lone_auto_bonus(self, work: list[_Work]) -> bool:
        """Whether the pass was a lone `auto` sequence's round of its bonus alone."""
        if len(work) != 1 or len(self.running) != 1:
            return False
        (item,) = work
        return item.active.acceptance is not None and item.tree is not None and not item.tree.size

    def _prefilled(self, active: _Active) -> None:
        active.prefilling = False
        if active.seq.resuming:  # its bonus, the next output token, was chosen before
            active.seq.end_resume()
        else:
            active.run.prefilled(active.seq.end_prefill())

    def _retire(self) -> None:
        for active in [a for a in self.running if a.run.out.finish_reason is not None]:
            self.running.remove(active)
            try:
                if not active.run.out.ids:  # cancelled before its first token
                    active.seq.caches.abandon()
                    finished = Finished(None, admitted=active.admitted)
                else:
                    active.seq.finish()
                    finished = Finished(active.run.result(), admitted=active.admitted)
            except Exception as error:
                active.seq.caches.abandon()
                finished = Finished(None, error, active.admitted)
            active.seq.release()
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
            active.seq.release()
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


def _step_passes(target, pool: CachePool, graphs: bool) -> StepPasses | None:
    """Static passes for plain steps, captured as CUDA graphs: on CUDA with graphs on, paged
    caches and a target that has them (elsewhere, or with --no-cuda-graphs, `forward_batch`
    runs); tree steps' beside them (`TreePasses`). Their padding block is taken now, while the
    pool's storage may still grow by it."""
    device = target.embed_tokens.weight.device
    if not graphs or device.type != "cuda" or pool.target_blocks is None:
        return None
    if not hasattr(target, "forward_steps"):
        return None
    pool.target_blocks.padding_block()
    return StepPasses(target, graphs=True)


def _draft_passes(
    drafter, target, pool: CachePool, steps: StepPasses | None, most: int
) -> DraftPasses | None:
    """Static passes for the drafts, captured as CUDA graphs beside the steps' (in their memory
    pool): where those are, with a drafter over paged caches. Their padding block is taken
    now, while the drafter pool's storage may still grow by it."""
    if steps is None or drafter is None or pool.draft_blocks is None:
        return None
    pool.draft_blocks.padding_block()
    return DraftPasses(drafter, target, True, steps.memory, most)


def _tops(drafting: list[_Active], drafts: torch.Tensor) -> dict[int, TopK]:
    """The top-k of every tree-drafting sequence's draft (drafts [n, B-1, V]), by id: one
    log_softmax, topk and host read for all those of one budget, not one each."""
    by_budget: dict[int, list[int]] = {}
    for index, active in enumerate(drafting):
        if active.seq.cfg.method in TREE_METHODS:
            by_budget.setdefault(active.seq.cfg.budget, []).append(index)
    tops = {}
    for budget, members in by_budget.items():
        logits = drafts if len(members) == len(drafting) else drafts[members]
        log_probs, token_ids = top_k_log_probs(logits, budget)
        for row, index in enumerate(members):
            tops[id(drafting[index])] = (log_probs[row], token_ids[row])
    return tops


def _keep_features(
    hidden: torch.Tensor | None, committed: list[tuple[_Sequence, list[int], int]]
) -> None:
    """Each speculative sequence's features of the tokens its round committed (its kept path
    in its segment, whose rows start at its start), gathered from the pass's `hidden` in one
    call for all of them (each sequence gathered its own before); when they are every row in
    order (plain rounds alone), views of `hidden` as it is."""
    kept = [
        (seq, [start + node for node in path]) for seq, path, start in committed if seq.speculative
    ]
    if not kept:
        return
    rows = [row for _, rows in kept for row in rows]
    if rows == list(range(hidden.shape[0])):  # every row, in order (a step of plain rounds)
        gathered = hidden
    else:
        gathered = hidden.index_select(0, to_device(np.array(rows), hidden.device))
    pieces = gathered.split([len(rows) for _, rows in kept])
    for (seq, _), piece in zip(kept, pieces, strict=True):
        seq.keep(piece)


def _round_tokens(active: _Active, rooms: tuple[int, int], drafts: bool) -> int:
    """The most tokens a round with `rooms` verifies: the bonus, and if it `drafts`, its tree."""
    return 1 + (min(active.seq.width - 1, rooms[1]) if drafts else 0)


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
    on_preempt: Callable[[], None] | None

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
        self.on_preempt: Callable[[], None] | None = None  # nor preemptions
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
