"""The benches' statistics: `ddops bench` (ops/bench) and `python -m engine bench` share them.

    order = rotated(methods, repeat)                 # each repeat starts with the next method
    ratios = paired_ratios(rates, rates_of_ar)       # same repeat (and prompt) -> one ratio each
    spread = median_interval(ratios)                 # Spread(median, low, high, n)
    interval_name(spread.n)                          # "95% interval", "75% interval (min-max)"
    spread.text("x")                                 # "1.31x (1.24-1.38)"
    row |= spread_fields("speedup", spread)          # speedup, speedup_low, speedup_high
    spread_in(row, "speedup", n)                     # ... and back
    exceeds_tau(ratio, tau)                          # above tau (+ slack): a disturbed measurement
    beyond_tau(rates, taus, "ar")                    # a repeat's methods above their tau
    verdict({"linear": s1, "ddtree:15": s2})         # a winner only when its interval clears
    verdict({"s2": ttft_ratio}, "s1", lower_is_better=True)  # a time: the lowest wins

Why these rules (issue 31): load that comes and goes during a run must land on every method
alike, so methods run interleaved and rotated, and a speedup is the ratio of two measurements
taken back to back (same repeat, same prompt), never of two cells measured minutes apart.
The interval is the distribution-free confidence interval of the median from order statistics:
with n values the k-th smallest and k-th largest, k the largest index whose binomial tail stays
within (1 - CONFIDENCE) / 2; below 9 values that is the min-max range, which holds the median
CONFIDENCE of the time only from 6 values on (at 3, 75%): `interval_name` says which it is. A speculative round
commits tau tokens on average and costs at least one target step, so a speedup above tau (with
TAU_SLACK for the timing's own jitter) is not a result: the ar measurement it was paired with
was slowed by something else. `RepeatSchedule` decides how many repeats a measurement gets:
at least `min_repeats`, more while its share of the time budget lasts, disturbed ones redone.
Pure Python: no torch, no I/O.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

CONFIDENCE = 0.95
TAU_SLACK = 0.10  # a measured speedup may exceed tau by this fraction before it is disturbed
MIN_REPEATS_FOR_VERDICT = 3  # below this many clean repeats no method is named the winner
T = TypeVar("T")
K = TypeVar("K")


@dataclass(frozen=True)
class Spread:
    """A figure's median over repeats and its interval (CONFIDENCE, distribution-free)."""

    median: float
    low: float
    high: float
    n: int

    def text(self, suffix: str = "", digits: int = 2, scale: float = 1.0) -> str:
        """`1.31x (1.24-1.38)`; a single value, or one that never varied, without one."""
        value = f"{self.median * scale:.{digits}f}{suffix}"
        if self.n < 2 or self.low == self.high:
            return value
        return f"{value} ({self.low * scale:.{digits}f}-{self.high * scale:.{digits}f})"

    def clears(self, other: Spread) -> bool:
        """This interval lies wholly above `other`'s."""
        return self.low > other.high

    def to_json(self) -> dict:
        return {"median": self.median, "low": self.low, "high": self.high, "n": self.n}

    @classmethod
    def from_json(cls, data: dict | None) -> Spread | None:
        return cls(**data) if data else None


def spread_fields(name: str, spread: Spread | None, digits: int | None = None) -> dict:
    """`spread` as a flat row's fields NAME (the median), NAME_low and NAME_high, each None
    without one; rounded to `digits` when given."""
    values = (spread.median, spread.low, spread.high) if spread else (None, None, None)
    if spread and digits is not None:
        values = tuple(round(v, digits) for v in values)
    return dict(zip((name, f"{name}_low", f"{name}_high"), values, strict=True))


def spread_in(row: Mapping, name: str, n: int) -> Spread | None:
    """The Spread of a flat row's fields (`spread_fields`) over `n` values; None without one."""
    if row.get(name) is None:
        return None
    return Spread(row[name], row[f"{name}_low"], row[f"{name}_high"], n)


def counted(n: int, noun: str) -> str:
    """`1 repeat`, `3 repeats`: a count and its noun, agreeing."""
    return f"{n} {noun}" + ("" if n == 1 else "s")


def rotated(items: Sequence[T], repeat: int) -> list[T]:
    """`items` starting at position `repeat` (mod its length): repeat 0 in the given order,
    repeat 1 from the second item on, ... so no method always runs first or last."""
    if not items:
        return []
    start = repeat % len(items)
    return [*items[start:], *items[:start]]


def _order_index(n: int, confidence: float) -> int:
    """The 1-based k of the median's interval (x_k, x_{n+1-k}): the largest k with
    P(Binomial(n, 1/2) <= k - 1) <= (1 - confidence) / 2, at least 1 (min-max)."""
    tail, cumulative, k = (1 - confidence) / 2, 0.0, 1
    for j in range(n // 2):
        cumulative += math.comb(n, j) / 2**n
        if cumulative > tail:
            break
        k = j + 1  # P(B <= k - 1) within the tail: x_(k) may be the lower bound
    return min(k, (n + 1) // 2)


def median_interval(values: Iterable[float], confidence: float = CONFIDENCE) -> Spread | None:
    """The median of `values` with its order-statistic interval; None for no values."""
    ordered = sorted(values)
    if not ordered:
        return None
    k = _order_index(len(ordered), confidence)
    return Spread(statistics.median(ordered), ordered[k - 1], ordered[-k], len(ordered))


def interval_coverage(n: int, confidence: float = CONFIDENCE) -> float:
    """How often the interval of `n` values holds the true median: 1 - 2 P(B(n, 1/2) < k)."""
    k = _order_index(n, confidence)
    return 1 - 2 * sum(math.comb(n, j) for j in range(k)) / 2**n


def interval_name(n: int, confidence: float = CONFIDENCE) -> str:
    """What the interval of `n` values is, for a label: "95% interval" when it covers that,
    else what it is, e.g. "75% interval (min-max)" at 3 values."""
    coverage = interval_coverage(n, confidence)
    if n < 2:
        return "no interval (1 value)"
    if coverage >= confidence:
        return f"{confidence:.0%} interval"
    return f"{math.floor(coverage * 100)}% interval (min-max)"


def paired_ratios(values: Mapping[K, float | None], base: Mapping[K, float | None]) -> list[float]:
    """value / base for every key (a repeat, or a prompt and repeat) both measured."""
    return [
        value / base[key]
        for key, value in values.items()
        if value is not None and base.get(key) not in (None, 0)
    ]


def exceeds_tau(speedup: float | None, tau: float | None, slack: float = TAU_SLACK) -> bool:
    """A speedup over ar that a method committing `tau` tokens a round cannot reach."""
    return speedup is not None and bool(tau) and speedup > tau * (1 + slack)


def beyond_tau(
    rates: Mapping[K, float | None], taus: Mapping[K, float | None], baseline: K
) -> dict[K, float]:
    """The methods of one repeat whose speedup over the baseline's rate in that repeat exceeds
    their tau (`exceeds_tau`): {method: speedup}; empty when the baseline has no rate."""
    base = rates.get(baseline)
    if not base:
        return {}
    speedups = {m: rate / base for m, rate in rates.items() if m != baseline and rate}
    return {m: speedup for m, speedup in speedups.items() if exceeds_tau(speedup, taus.get(m))}


@dataclass(frozen=True)
class Verdict:
    """Which method won a column, if any one clearly did."""

    winner: str | None
    leaders: tuple[str, ...]  # the top method and every method whose interval overlaps it
    text: str

    def to_json(self) -> dict:
        return {"winner": self.winner, "leaders": list(self.leaders), "text": self.text}


def verdict(
    speedups: Mapping[str, Spread | None], baseline: str = "ar", *, lower_is_better: bool = False
) -> Verdict:
    """Name a winner only when its speedup interval clears every other method's and the
    baseline's 1.0, over at least MIN_REPEATS_FOR_VERDICT clean repeats; else say no method
    clearly won and list the leaders (the top one and those whose intervals overlap it).
    `lower_is_better`: the figures are ratios of a time (a TTFT over the baseline's), so the
    lowest wins, and only when its interval lies wholly below every other's."""
    one = Spread(1.0, 1.0, 1.0, MIN_REPEATS_FOR_VERDICT)
    measured = {m: s for m, s in speedups.items() if s is not None and m != baseline}
    if not measured:
        return Verdict(None, (), f"no verdict: no method measured against {baseline}")
    spreads = {baseline: one, **measured}
    sign = 1 if lower_is_better else -1
    ranked = sorted(spreads, key=lambda m: sign * spreads[m].median)
    top = ranked[0]

    def beats(a: Spread, b: Spread) -> bool:
        return b.clears(a) if lower_is_better else a.clears(b)

    leaders = tuple(m for m in ranked if m == top or not beats(spreads[top], spreads[m]))
    few = min(s.n for s in measured.values())
    if len(leaders) == 1 and few >= MIN_REPEATS_FOR_VERDICT:
        if top == baseline:
            worse = "higher" if lower_is_better else "slower"
            return Verdict(top, leaders, f"{baseline} wins: every other is clearly {worse}")
        against = f"of {baseline}'s" if lower_is_better else f"over {baseline}"
        return Verdict(
            top, leaders, f"{top} wins: {spreads[top].text('x')} {against}, clear of the rest"
        )
    listed = ", ".join(f"{m} {spreads[m].text('x')}" for m in leaders)
    why = "intervals overlap"
    if few < MIN_REPEATS_FOR_VERDICT:
        why = f"only {counted(few, 'clean repeat')}"
    return Verdict(None, leaders, f"no clear winner at this noise ({why}): leaders {listed}")


class RepeatSchedule:
    """How many repeats one measurement (a scenario and length of `ddops bench`, a prompt of
    `python -m engine bench`) gets: at least `min_repeats` clean ones; more, up to
    `max_repeats`, while the next one fits in `share_s` seconds at the pace so far. A disturbed
    repeat is redone while the share lasts, and past it at most `min_repeats` times over (a
    machine that stays busy ends the measurement with what it has): under bursts the share buys
    clean repeats, where a few leave a median that moves with the bursts."""

    def __init__(self, min_repeats: int, max_repeats: int, share_s: float) -> None:
        self.min_repeats = min_repeats
        self.max_repeats = max(max_repeats, min_repeats)
        self.share_s = share_s
        self.clean = 0
        self.disturbed = 0
        self.spent_s = 0.0

    @property
    def attempts(self) -> int:
        return self.clean + self.disturbed

    def record(self, seconds: float, *, disturbed: bool) -> None:
        self.spent_s += seconds
        if disturbed:
            self.disturbed += 1
        else:
            self.clean += 1

    def more(self) -> bool:
        """Whether to run another repeat."""
        if self.clean >= self.max_repeats:
            return False
        pace = self.spent_s / self.attempts if self.attempts else 0.0
        if self.spent_s + pace <= self.share_s:
            return True
        return self.clean < self.min_repeats and self.disturbed <= self.min_repeats
