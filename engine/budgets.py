"""Tree budgets chosen for the batch (`auto`): each scheduler step picks every `auto` sequence's
node count, 0 (plain decoding: its bonus token alone, no draft) to its cap, to maximise the
step's proportional fairness: the sum over its sequences of log(tokens a second). Alone, that
is the most tokens a second; beside others, a tree must pay for the time it adds to each of
their steps, not only to the batch's total (a throughput objective lets a sequence whose drafts
are accepted slow every other one: six chats at once then finish later than with no drafts).

The model, in three parts:
  cost      `LinearCost`: a target pass's seconds = fixed + per token * its tokens (prefill
            pieces included) + per tree * its segments of more than one token (a tree's GDN
            and mask work: the step from a bonus alone to a 2-token tree is dearer than a
            token); a draft pass's = fixed + per sequence * its sequences. Least squares over
            what the scheduler measured, recent passes weighing most (each older sample counts
            FORGET times less), pulled toward a prior whose shape is per device kind and whose
            scale is the first sample. Before any sample every `auto` sequence drafts its cap;
  gain      `Acceptance` (one per sequence): node i of a best-first tree (DDTree's order, its
            cumulative log-probs non-increasing) is accepted with probability
            scale * exp(log-prob of its path under the drafter), at most 1, where scale is the
            sequence's accepted drafted tokens over the probability mass it verified, both
            decayed by DECAY a round and started from a prior of 1;
  choice    `choose`: the node counts maximising sum log(1 + gains taken) over the choosing
            sequences less n * log(seconds of the step), n the step's decoding sequences (the
            others' tokens are fixed: only the seconds they share move): at a price of a
            second each sequence's best count is its own (its gains a prefix sum, every count
            tried at once); the fairest of 16 prices' choices, then single moves that still
            gain (see `choose`). A tree's entry is its per-tree cost (before the draft, its
            sequence's part of the draft pass too). The draft pass's fixed seconds are the
            step's, paid once if any sequence drafts: the choice is made with them paid, and
            kept only if it beats drafting none.
A sequence decoding alone is asked `drafting_alone` instead: its drafted round runs generate()'s
static passes (engine/scheduler.py `_solo_round`), a cost of its own, measured whole
(`observe_solo`, a running mean of the seconds from its step's start to the next step's, so
what a round costs beside its passes counts too) rather than fitted beside the batched passes;
against it, a round of its bonus alone, measured the same way (`observe_alone`; until then the
pass fit at one token). Its gain is its mean accepted per drafted round.
The scheduler asks twice a step: `drafting` before the drafter runs (who drafts: gains from each
sequence's running profile of past trees, entry = its part of the draft pass) and `nodes` after
(how many of each fresh tree's nodes to verify: its own path probabilities, the draft paid). A
sequence that has not drafted for PROBE_AFTER rounds drafts again, so a sequence turned off by a
busy batch sees the batch thin out and its own acceptance change; a probe in a drafted step that
did not beat the step without a draft (or whose tree got no node) doubles that wait (up to
PROBE_MAX rounds: on a busy batch a probe's draft costs more than it tells), one whose tree got
nodes in a step that paid resets it. When the step drafts at all, every sequence whose wait is
half over probes with it: the probes of sequences that joined at different times would each pay
the draft pass's fixed seconds in a step of their own; drawn into one pass, their waits stay in
step from then on. A new sequence's profile starts as the server's (every fresh tree's, decayed
by POPULATION_DECAY): it drafts its first round when that profile says a tree pays (or the server
has drafted none yet), not to learn what the others' trees already tell; its wait to its first
probe is the server's last lesson at the size of the batch it joins (`probe_waits`, by batches
of 2, up to 4, up to 8...: doubled by each drafted step of that size that did not pay, reset by
one that did; drafting may pay alone and not at six), and when its batch grows or thins to
another size, that size's lesson (prefilling sequences counted: they wait on the step too).
Alone there is no such lesson: each sequence waits PROBE_AFTER rounds, then as long as its own
probes taught it. What a lone draft returns is its own text's acceptance, which the last prompt
does not tell (the demo's six chats accept 0.7 to 6.3 drafted tokens a round); a server-wide
lone lesson, doubled by the chats whose trees do not pay, stopped every later chat's probes
within its 96 tokens, and auto decoded plainly where ddtree:15 was 1.13-1.20x ar
(engine/NOTES.md, session 32).

Lossless: a budget only says how many of the tree's first nodes are verified (a best-first tree
of k nodes is the first k of a larger one), and every output token is still the target's own
choice. Memory: per sequence an `Acceptance` keeps its profile (cap float64s) and a few numbers;
the server one profile more and its last answer that none drafts (`_Quiet`, kept while
nothing it read changed).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

FORGET = 0.98  # a cost sample's weight falls by this factor each newer one (~50 samples count)
DECAY = 0.95  # acceptance sums fall by this each round (~20 rounds count)
PROFILE_KEEP = 0.5  # the profile's share kept each drafted round
PROBE_AFTER = 8  # rounds without a draft before a sequence drafts again (at first)
# The longest wait, after probes that did not pay: a probe drafted into a busy batch costs it
# ~6 plain steps more than its tree returns (six demo sequences on the CPU: a 34 ms step against
# 3.8 ms ones, ~2.5 tokens accepted each), ~9% of a batch probing every 64 rounds, ~2% at 256.
PROBE_MAX = 256
PRIOR_WEIGHT = 0.05  # each of the prior's points, against ~50 of measured weight
MAX_ITERATIONS = 20
RESOLVE_AFTER = 8  # new samples before a cost fit's weights are solved again
# Passes before a kept answer that none drafts is made anew with the fits' newer weights (unless
# what else it reads changed first): made anew, six sequences' choice costs ~0.4 ms of host time
# in the serving loop, ~10% of their plain step on the CPU. A drafted step's node counts read
# the newest weights.
CHOICE_PASSES = 32
_SERIALS = itertools.count()  # Acceptance.serial
PRICE_STEPS = np.linspace(0.0, 1.0, 16)  # `choose`'s prices of a second, geometric steps
SOLO_KEEP = 0.9  # a lone drafted round's running mean of seconds keeps this share each round
PRIOR_ROUNDS = 4  # the prior's weight in a sequence's mean accepted, in rounds
POPULATION_DECAY = 0.99  # the server's accepted per drafted round: ~100 rounds count
# The priors' shapes, per device kind: a pass's seconds per (pass, token, tree) and the draft's
# per (pass, sequence), relative to the first; the first sample scales them. Demo pair on the
# CPU (engine/NOTES.md): a pass 6.9 ms, a tree segment +2.7 ms, a token +0.25 ms; a draft pass
# 3 ms + 2.5 ms a sequence. A GPU's pass is flat far longer (memory-bound at small batches).
PASS_PRIOR = {"cpu": (1.0, 0.04, 0.4), "cuda": (1.0, 0.004, 0.05)}
DRAFT_PRIOR = {"cpu": (1.0, 0.8), "cuda": (1.0, 0.1)}
PASS_DESIGN = ((1, 1, 0), (1, 2, 1), (1, 256, 16))  # where the prior's points sit
DRAFT_DESIGN = ((1, 1), (1, 16))


class LinearCost:
    """seconds = features . weights (a pass: 1, its tokens, its tree segments; a draft: 1, its
    sequences), least squares over the samples with forgetting, pulled toward a prior (its
    points at `design`, weighing PRIOR_WEIGHT each, never forgotten: the fit is defined from
    the first sample on, and the prior rules what the samples do not vary)."""

    def __init__(self, shape: tuple[float, ...], design: tuple[tuple[int, ...], ...]) -> None:
        self.shape, self.design = np.array(shape, np.float64), np.array(design, np.float64)
        size = len(shape)
        # sum w x x^T and sum w x y, as lists: a pass's update is a few float operations
        self.gram = [[0.0] * size for _ in range(size)]
        self.moment = [0.0] * size
        self.prior: tuple[np.ndarray, np.ndarray] | None = None
        self._weights: np.ndarray | None = None
        self._unsolved = 0  # samples since the weights were solved
        self.samples = 0  # ever

    def observe(self, features: tuple[int, ...], seconds: float) -> None:
        if self.prior is None:  # the first sample sets the prior's scale
            x = np.array(features, np.float64)
            weights = self.shape * seconds / float(self.shape @ x)
            d = self.design
            self.prior = (PRIOR_WEIGHT * d.T @ d, PRIOR_WEIGHT * d.T @ (d @ weights))
        self.gram = [
            [g * FORGET + a * b for g, b in zip(row, features, strict=True)]
            for row, a in zip(self.gram, features, strict=True)
        ]
        self.moment = [m * FORGET + a * seconds for m, a in zip(self.moment, features, strict=True)]
        self._unsolved += 1
        self.samples += 1

    @property
    def known(self) -> bool:
        return self.prior is not None

    @property
    def weights(self) -> np.ndarray:
        """The fit's weights, non-negative: solved when read, again once RESOLVE_AFTER samples
        came since (a sample moves them by ~2%; an ar-only server, which observes every pass
        and never reads them, never solves)."""
        if self._weights is None or self._unsolved >= RESOLVE_AFTER:
            gram, moment = np.array(self.gram), np.array(self.moment)
            solved = np.linalg.solve(gram + self.prior[0], moment + self.prior[1])
            self._weights, self._unsolved = np.maximum(solved, 0.0), 0
        return self._weights

    def seconds(self, *features: float) -> float:
        return float(self.weights @ np.array(features, np.float64))


@dataclass
class Acceptance:
    """One `auto` sequence's acceptance so far (see the module docstring)."""

    cap: int
    accepted: float = 1.0  # drafted tokens accepted (decayed), the prior's 1
    verified: float = 1.0  # the drafter's probability mass of the nodes verified (decayed)
    prior_mean: float = 1.0  # accepted per drafted round before its own (the server's so far)
    own_accepted: float = 0.0  # its drafted tokens accepted (decayed)
    own_rounds: float = 0.0  # its rounds that verified a tree (decayed)
    profile: np.ndarray | None = None  # [cap] expected gain by node rank, over past trees
    skipped: int = 0  # rounds in a row without a draft
    probe_after: int = PROBE_AFTER  # rounds without a draft before it drafts again
    batch: int = 1  # the `batch_size` of the steps its `probe_after` was learned in
    version: int = 0  # changes whenever its predictions may (a draft, a verified round)
    serial: int = field(default_factory=lambda: next(_SERIALS))  # one of its own, ever

    @property
    def probe_due(self) -> bool:
        """It has gone `probe_after` rounds without a draft: it drafts again."""
        return self.skipped >= self.probe_after

    @property
    def scale(self) -> float:
        return self.accepted / self.verified

    def gains(self, log_probs: np.ndarray) -> np.ndarray:
        """Expected accepted tokens of each node of a best-first tree (non-increasing)."""
        return np.minimum(self.scale * np.exp(log_probs.astype(np.float64)), 1.0)

    def drafted(self, log_probs: np.ndarray) -> None:
        """A fresh tree's path log-probs (in build order) join the profile."""
        fresh = np.zeros(self.cap)
        fresh[: len(log_probs)] = np.exp(log_probs[: self.cap])
        if self.profile is not None:
            fresh = PROFILE_KEEP * self.profile + (1 - PROFILE_KEEP) * fresh
        self.profile, self.skipped = fresh, 0
        self.version += 1

    def paid(self, worth: bool) -> None:
        """Whether its draft paid (its tree got nodes in a step that beat the step without a
        draft; alone: drafting still pays after it): the wait before the next probe resets,
        or doubles."""
        self.probe_after = PROBE_AFTER if worth else min(2 * self.probe_after, PROBE_MAX)

    @property
    def mean_accepted(self) -> float:
        """Drafted tokens accepted per drafted round: its own (decayed as the sums are) beside
        PRIOR_ROUNDS rounds of the prior (a generation's first rounds alone say little)."""
        prior = PRIOR_ROUNDS * self.prior_mean
        return (self.own_accepted + prior) / (self.own_rounds + PRIOR_ROUNDS)

    def verified_round(self, log_probs: np.ndarray, accepted: int) -> None:
        """A round verified nodes of path log-probs `log_probs` and accepted `accepted` of them."""
        self.accepted = self.accepted * DECAY + accepted
        self.verified = self.verified * DECAY + float(np.exp(log_probs).sum())
        self.own_accepted = self.own_accepted * DECAY + accepted
        self.own_rounds = self.own_rounds * DECAY + 1
        self.version += 1

    def predicted(self, room: int) -> np.ndarray:
        """Gains expected of its next tree, from the profile (sorted: a mean of sorted rows)."""
        profile = np.zeros(self.cap) if self.profile is None else self.profile
        return np.minimum(self.scale * profile[:room], 1.0)


@dataclass
class Candidate:
    """A sequence the step may give nodes: their gains (non-increasing) and its entry seconds,
    paid once if it takes any (its segment becoming a tree; before the draft, its draft too)."""

    gains: np.ndarray
    entry: float = 0.0


def choose(
    candidates: Sequence[Candidate], sequences: int, base_seconds: float, per_token: float
) -> list[int]:
    """Node counts for `candidates` maximising the step's `fairness` (see the module docstring).

    The sequences interact only through the step's seconds T, whose marginal worth at the
    optimum is sequences / T: at a price p a second, each candidate alone takes the count of
    the most log(tokens) - p * seconds. 16 prices from sequences / (T with every node) to
    sequences / base_seconds are tried at once (a coordinated move, six trees that pay only
    together, is found: no single one of them pays alone), the fairest of those choices and
    of none kept, then the best move of one candidate to its best count given the others'
    is made while one gains. None taking a node at the lowest price means none is the best:
    each count's log(seconds) rises by at least that price times its seconds. Ties keep the
    fewer nodes."""
    if not candidates:
        return []
    value, cost = _options(candidates, per_token)
    base = max(base_seconds, 1e-12)
    most = base + float(cost.max(axis=1).sum())
    if not (value > sequences / most * cost).any():  # none takes a node at the lowest price
        return [0] * len(candidates)
    prices = sequences / (most * (base / most) ** PRICE_STEPS)  # lowest to highest
    picks = np.argmax(value[None] - prices[:, None, None] * cost[None], axis=2)  # [P, n]
    picks = np.vstack([np.zeros_like(picks[:1]), picks])  # none, then each price's
    rows = np.arange(len(candidates))
    scores = value[rows, picks].sum(axis=1) - sequences * np.log(base + cost[rows, picks].sum(1))
    counts = picks[int(np.argmax(scores))].copy()
    total = base + cost[rows, counts].sum()
    for _ in range(MAX_ITERATIONS):  # the best single move, while one gains
        rest = total - cost[rows, counts]
        scores = value - sequences * np.log(rest[:, None] + cost)  # [n, counts]
        best = scores.argmax(axis=1)
        gains = scores[rows, best] - scores[rows, counts]
        i = int(gains.argmax())
        if gains[i] <= 1e-12:
            break
        total += cost[i, best[i]] - cost[i, counts[i]]
        counts[i] = best[i]
    return counts.tolist()


def _options(candidates: Sequence[Candidate], per_token: float) -> tuple[np.ndarray, np.ndarray]:
    """Each candidate's log(tokens) and added seconds by node count, [n, most nodes + 1] (a
    count beyond a candidate's nodes: -inf, never chosen)."""
    lengths = np.array([len(candidate.gains) for candidate in candidates])
    gains = np.zeros((len(candidates), lengths.max() + 1))
    for row, candidate in zip(gains, candidates, strict=True):
        row[1 : len(candidate.gains) + 1] = candidate.gains
    nodes = np.arange(gains.shape[1])
    entries = np.array([candidate.entry for candidate in candidates])
    value = np.where(nodes <= lengths[:, None], np.log1p(gains.cumsum(axis=1)), -np.inf)
    cost = per_token * nodes + np.where(nodes > 0, entries[:, None], 0.0)
    return value, cost


def fairness(
    candidates: Sequence[Candidate],
    counts: Sequence[int],
    sequences: int,
    base_seconds: float,
    per_token: float,
) -> float:
    """The step's sum of log(tokens a second) over its `sequences` with `counts` nodes for
    `candidates` (each its bonus and the gains taken), less the others' fixed log(tokens)."""
    taken = [(c, k) for c, k in zip(candidates, counts, strict=True) if k]
    tokens = sum(math.log1p(float(c.gains[:k].sum())) for c, k in taken)
    seconds = base_seconds + sum(per_token * k + c.entry for c, k in taken)
    return tokens - sequences * math.log(max(seconds, 1e-12))


@dataclass
class _Quiet:
    """`Budgets.drafting`'s last answer when no sequence drafted, kept for the steps in which
    nothing it read can change: the same sequences, none of them changed (no draft, no tree
    verified: each its serial and version), the same baseline, the fits in the same
    CHOICE_PASSES samples, no probe due and every node room still at or past its cap. (The
    fits' weights are not read meanwhile: in the serving loop a solve took ~100 us, its numpy
    code cold after a pass.)"""

    base: Baseline
    fits: tuple[int, int]  # `Budgets._fits_epoch`
    sequences: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Baseline:
    """The step's work beside the sequences choosing: the pass's tokens and segments of more
    than one token (each choosing sequence counted as its bonus alone: one token, one row),
    and how many sequences wait on it (decoding, the choosing ones included, or prefilling)."""

    tokens: int
    trees: int
    sequences: int


class Budgets:
    """The scheduler's budget chooser: the two cost fits and the step's two choices."""

    def __init__(self, device: str = "cpu") -> None:
        self.passes = LinearCost(PASS_PRIOR.get(device, PASS_PRIOR["cpu"]), PASS_DESIGN)
        self.drafts = LinearCost(DRAFT_PRIOR.get(device, DRAFT_PRIOR["cpu"]), DRAFT_DESIGN)
        self.solo_round: float | None = None  # seconds of a lone sequence's drafted round
        self.bonus_round: float | None = None  # and of its round of the bonus alone
        self.population = (0.0, 0.0)  # every auto sequence's accepted, drafted rounds (decayed)
        self.trees = (np.zeros(0), 0.0)  # every fresh tree's node probabilities, trees (decayed)
        self._quiet: _Quiet | None = None  # `drafting`'s last answer when none drafted
        self.probe_waits: dict[int, int] = {}  # a new sequence's wait to its first probe, by
        # batch size (see `batch_size`): the last drafted step's lesson there

    def drafting_alone(self, acc: Acceptance) -> bool:
        """Whether a sequence decoding alone drafts this round: its tokens per second drafting
        (its bonus and its mean accepted, over a measured solo round) against its bonus alone
        (over a one-token pass). Unmeasured, due a probe, or never drafted: it drafts. Its
        mean, not one tree's profile: a tree verified whole costs the same whatever its
        drafter's confidence, so only what its rounds accept on average decides."""
        self._joined(acc, 1)
        if self.solo_round is None or not self.passes.known:
            return True
        if acc.profile is None or acc.probe_due:
            return True
        drafted_rate = (1 + acc.mean_accepted) / self.solo_round
        bonus = self.bonus_round if self.bonus_round is not None else self.passes.seconds(1, 1, 0)
        return drafted_rate > 1 / bonus

    def new_sequence(self, cap: int, batch: int = 1) -> Acceptance:
        """An `auto` sequence's acceptance, its priors the server's so far: its mean accepted,
        the profile of every sequence's trees (with one, it need not draft its first round to
        be judged: on a busy batch, where drafting does not pay, it waits for its first
        probe), and the wait to that probe that drafted steps of `batch` sequences taught."""
        accepted, rounds = self.population
        acc = Acceptance(cap, prior_mean=accepted / rounds if rounds else 1.0, batch=0)
        self._joined(acc, batch)
        trees, weight = self.trees
        if weight:
            acc.profile = np.zeros(cap)
            known = min(cap, len(trees))
            acc.profile[:known] = trees[:known] / weight
        return acc

    def _joined(self, acc: Acceptance, sequences: int) -> None:
        """`acc`'s sequence is in a step of `sequences`: in a batch of another size than the
        one it learned its wait to the next probe in, it takes that size's (the last lesson
        there). One that joined alone, before the others of a burst that arrived with it were
        admitted, would otherwise probe among them after PROBE_AFTER rounds, where drafting
        had stopped paying long ago (six chats sent at once through the server: one such
        wasted draft pass a burst, every burst)."""
        size = batch_size(sequences)
        if acc.batch != size:
            acc.batch, acc.probe_after = size, self.probe_waits.get(size, PROBE_AFTER)

    def drafted(self, acc: Acceptance, log_probs: np.ndarray) -> None:
        """`acc`'s sequence drafted a tree of path log-probs `log_probs` (the server's profile
        follows every sequence's, as theirs do)."""
        acc.drafted(log_probs)
        trees, weight = self.trees
        if len(trees) < len(log_probs):
            trees = np.concatenate([trees, np.zeros(len(log_probs) - len(trees))])
        trees = POPULATION_DECAY * trees
        trees[: len(log_probs)] += np.exp(log_probs.astype(np.float64))
        self.trees = (trees, POPULATION_DECAY * weight + 1)

    def verified(self, acc: Acceptance, log_probs: np.ndarray, accepted: int) -> None:
        """A round of `acc`'s sequence verified nodes of path log-probs `log_probs` and
        accepted `accepted` of them (the server's mean follows every sequence's)."""
        acc.verified_round(log_probs, accepted)
        total, rounds = self.population
        self.population = (total * POPULATION_DECAY + accepted, rounds * POPULATION_DECAY + 1)

    def observe_solo(self, seconds: float) -> None:
        """A lone sequence's drafted round (its draft, verify and commit) took `seconds`."""
        self.solo_round = _running_mean(self.solo_round, seconds)

    def observe_alone(self, seconds: float) -> None:
        """A lone sequence's round of its bonus alone (its pass and commit) took `seconds`."""
        self.bonus_round = _running_mean(self.bonus_round, seconds)

    def drafting(self, sequences: list[tuple[Acceptance, int]], base: Baseline) -> list[bool]:
        """Which `auto` sequences (each its acceptance and node room) draft this step. A busy
        batch's answer that none does is kept while it cannot change (`_Quiet`): made anew
        each step, six sequences' took ~50 us of host time in the serving loop, a solve of
        the fit ~100 us every 8 passes (its numpy code cold after a pass), where auto at six
        at once was 0.96x ar's tok/s (engine/NOTES.md, session 29)."""
        if self._still_quiet(sequences, base):
            return [False] * len(sequences)
        self._quiet = None
        for acc, _ in sequences:
            self._joined(acc, base.sequences)
        if not self.passes.known or not self.drafts.known:
            return [True] * len(sequences)
        counts = self._paying(sequences, base)
        drafts = [
            count > 0 or acc.profile is None or acc.probe_due
            for count, (acc, _) in zip(counts, sequences, strict=True)
        ]
        if any(drafts):  # the pass's fixed seconds are paid: probes half due join it
            drafts = [
                d or acc.skipped >= acc.probe_after // 2
                for d, (acc, _) in zip(drafts, sequences, strict=True)
            ]
        elif not _choice_moves(sequences):
            self._quiet = _Quiet(base, self._fits_epoch(), _versions(sequences))
        return drafts

    def _still_quiet(self, sequences: list[tuple[Acceptance, int]], base: Baseline) -> bool:
        """Whether the kept answer that none drafts holds for this step."""
        quiet = self._quiet
        if quiet is None or quiet.base != base or quiet.fits != self._fits_epoch():
            return False
        return quiet.sequences == _versions(sequences) and not _choice_moves(sequences)

    def _fits_epoch(self) -> tuple[int, int]:
        """Which CHOICE_PASSES samples each cost fit is in: a choice is made anew in the next."""
        return self.passes.samples // CHOICE_PASSES, self.drafts.samples // CHOICE_PASSES

    def _paying(self, sequences: list[tuple[Acceptance, int]], base: Baseline) -> list[int]:
        """The node counts the sequences' predicted trees would get with the draft paid (all 0
        when the draft pass would not pay for itself)."""
        (_, per_token, per_tree), (fixed, per_sequence) = self.passes.weights, self.drafts.weights
        entry = per_tree + per_sequence
        candidates = [Candidate(acc.predicted(room), entry) for acc, room in sequences]
        seconds, n = self._seconds(base), base.sequences
        counts = choose(candidates, n, seconds + fixed, per_token)
        if fairness(candidates, counts, n, seconds + fixed, per_token) <= -n * math.log(
            max(seconds, 1e-12)
        ):
            return [0] * len(candidates)  # the draft pass would not pay for itself
        return counts

    def nodes(
        self, trees: list[tuple[Acceptance, np.ndarray]], base: Baseline, draft_seconds: float
    ) -> list[int]:
        """How many nodes of each fresh tree (its acceptance, its path log-probs) to verify,
        the draft's `draft_seconds` spent. The trees' sequences learn whether the draft paid:
        the step with their nodes and the draft's seconds against the step without a draft
        (a probe drawn into a busy batch's draft may get nodes, the draft being spent, and
        the step still be slower than without it); a tree that got nodes in a step that paid
        resets its wait to the next probe, any other doubles it."""
        if not self.passes.known:
            return [len(log_probs) for _, log_probs in trees]
        _, per_token, per_tree = self.passes.weights
        candidates = [Candidate(acc.gains(log_probs), per_tree) for acc, log_probs in trees]
        undrafted, n = self._seconds(base), base.sequences
        counts = choose(candidates, n, undrafted + draft_seconds, per_token)
        drafted = fairness(candidates, counts, n, undrafted + draft_seconds, per_token)
        paid = drafted > -n * math.log(max(undrafted, 1e-12))
        for (acc, _), count in zip(trees, counts, strict=True):
            acc.paid(paid and count > 0)
        self._learned(paid, n)
        return counts

    def solo_paid(self, acc: Acceptance, pays: bool) -> None:
        """A lone sequence's probe, or a drafted round after which drafting still pays (or
        not): its own wait to the next probe resets or doubles (alone, no lesson is kept for
        the next sequence: see the module docstring)."""
        acc.paid(pays)

    def _learned(self, paid: bool, sequences: int) -> None:
        """A drafted step of `sequences` paid or not: the wait of a sequence joining a batch
        of that size (two or more) resets or doubles."""
        size = batch_size(sequences)
        if size == 1:
            return
        wait = self.probe_waits.get(size, PROBE_AFTER)
        self.probe_waits[size] = PROBE_AFTER if paid else min(2 * wait, PROBE_MAX)

    def observe_pass(self, tokens: int, trees: int, seconds: float) -> None:
        self.passes.observe((1, tokens, trees), seconds)

    def observe_draft(self, sequences: int, seconds: float) -> None:
        self.drafts.observe((1, sequences), seconds)

    def _seconds(self, base: Baseline) -> float:
        return self.passes.seconds(1, base.tokens, base.trees)


def _versions(sequences: list[tuple[Acceptance, int]]) -> tuple[tuple[int, int], ...]:
    """Which sequences, each as it stands (its serial and version): `_Quiet.sequences`."""
    return tuple((acc.serial, acc.version) for acc, _ in sequences)


def _choice_moves(sequences: list[tuple[Acceptance, int]]) -> bool:
    """Whether a step's choice of who drafts may differ from one step to the next with none
    of `sequences` changed: a probe due, or a node room within the cap (one token less a
    step: `_paying` reads the room up to the cap)."""
    return any(acc.probe_due or room < acc.cap for acc, room in sequences)


def batch_size(sequences: int) -> int:
    """The bucket of a batch of `sequences` a probe's lesson is kept for: the power of two at
    or above it (1, 2, 4, 8, ...)."""
    return 1 << max(0, sequences - 1).bit_length()


def _running_mean(last: float | None, seconds: float) -> float:
    return seconds if last is None else SOLO_KEEP * last + (1 - SOLO_KEEP) * seconds
