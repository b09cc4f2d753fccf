"""A stored run's figures, computed from its samples with the statistics of engine.bench_stats.

    by_repeat = repeat_figures(cell["samples"])      # {repeat: RepeatFigure(rate, tau, ...)}
    disturbed_methods(figures_by_method)             # which methods' speedups beat their tau
    rows = rows_from_cells(cells)                    # one row per cell, every figure with spread
    verdicts(rows)                                   # per scenario and length: winner or leaders

A repeat's rate is its decode tok/s over the cell's requests of that repeat (for the agentic
scenario: every turn with the prefix cache on, token-weighted), so a speedup pairs a method's
repeat with ar's same repeat (same prompt; in the agentic scenario the same transcript shape,
one session each). Samples of a disturbed repeat are kept in the cell, marked, and left out of
every figure. A cell stored before issue 31 (no samples) shows its stored metrics, no spread.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from engine.bench_stats import (
    Spread,
    beyond_tau,
    median_interval,
    paired_ratios,
    spread_fields,
    spread_in,
    verdict,
)
from ops.bench.client import Sample
from ops.bench.matrix import SCENARIOS, parse_method
from ops.methods import METHODS

BASELINE = "ar"
CACHE_OFF = "off"  # a sample's "cache" field: the agentic turn re-sent with the cache off
# Figures with a spread: the row has NAME (the median), NAME_low and NAME_high.
SPREAD_FIGURES = ("decode_tok_s", "speedup", "ttft_s")
POINT_FIGURES = (
    "e2e_tok_s",
    "tpot_p50_s",
    "tpot_p90_s",
    "tau",
    "rounds",
    "completion_tokens",
    "reasoning_tokens",
    "answer_tokens",
    "requests",
    "repeats",
    "disturbed",
    "others_cpu",
)


@dataclass(frozen=True)
class RepeatFigure:
    """One repeat of one cell."""

    rate: float | None  # decode tok/s over the repeat's requests
    tau: float | None  # tokens committed per round over them (round-weighted)
    disturbed: bool


def measured(samples: Iterable[dict]) -> list[dict]:
    """The samples that count for speed: not the agentic scenario's cache-off re-sends."""
    return [s for s in samples if s.get("cache") != CACHE_OFF]


def _rate(samples: list[Sample]) -> float | None:
    decoding = [s for s in samples if s.decode_tok_s is not None]
    seconds = sum(s.decode_s for s in decoding)
    return sum(s.completion_tokens - 1 for s in decoding) / seconds if seconds else None


def _tau(samples: list[Sample]) -> float | None:
    rounds = sum(s.rounds for s in samples)
    return sum(s.tau * s.rounds for s in samples) / rounds if rounds else None


def repeat_figures(samples: Iterable[dict]) -> dict[int, RepeatFigure]:
    """Each repeat's rate and tau (over its requests with the cache on), and whether the
    repeat was marked disturbed."""
    by_repeat: dict[int, list[dict]] = {}
    for entry in measured(samples):
        by_repeat.setdefault(entry.get("repeat", 0), []).append(entry)
    figures = {}
    for repeat, entries in sorted(by_repeat.items()):
        parsed = [Sample.from_json(e) for e in entries]
        disturbed = any(e.get("disturbed") for e in entries)
        figures[repeat] = RepeatFigure(_rate(parsed), _tau(parsed), disturbed)
    return figures


def disturbed_methods(by_method: dict[str, RepeatFigure]) -> dict[str, float]:
    """The methods of one repeat whose speedup over ar's same repeat exceeds their tau:
    {method: speedup}. Empty without an ar measurement."""
    rates = {method: figure.rate for method, figure in by_method.items()}
    taus = {method: figure.tau for method, figure in by_method.items()}
    return beyond_tau(rates, taus, BASELINE)


# -- rows ------------------------------------------------------------------------------------------
def _method_order(label: str) -> tuple[int, int]:
    method = parse_method(label)
    return METHODS.index(method.name), method.budget or 0


def _column_order(row: dict) -> tuple[int, int]:
    return SCENARIOS.index(row["scenario"]), row["length"]


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summarize(samples: Sequence[Sample]) -> dict:
    """Figures pooled over requests (token-weighted rates, round-weighted tau): a cell's
    `metrics` as stored, and the point figures of its row."""
    tokens = sum(s.completion_tokens for s in samples)
    tpots = [s.tpot_s for s in samples if s.tpot_s is not None]
    return {
        "requests": len(samples),
        "completion_tokens": tokens,
        "decode_tok_s": _rate(samples),
        "e2e_tok_s": tokens / sum(s.e2e_s for s in samples),
        "ttft_s": statistics.median(s.ttft_s for s in samples),
        "tpot_p50_s": percentile(tpots, 50),
        "tpot_p90_s": percentile(tpots, 90),
        "tau": _tau(samples),
        "rounds": sum(s.rounds for s in samples) / len(samples),
    }


def _clean(cell: dict) -> list[dict]:
    return [s for s in cell.get("samples") or [] if not s.get("disturbed")]


def _sample_figures(cell: dict) -> dict:
    """A cell's figures over its clean samples (the cache-on ones)."""
    clean = _clean(cell)
    samples = [Sample.from_json(s) for s in measured(clean)]
    if not samples:
        return {}
    rates = [f.rate for f in repeat_figures(clean).values() if f.rate is not None]
    tokens = sum(s.completion_tokens for s in samples)
    reasoning = [s.reasoning_tokens for s in samples if s.reasoning_tokens is not None]
    shares = [s["others_cpu"] for s in clean if s.get("others_cpu") is not None]
    row = summarize(samples)
    row |= spread_fields("decode_tok_s", median_interval(rates))
    row |= spread_fields("ttft_s", median_interval(s.ttft_s for s in samples))
    row |= {
        "reasoning_tokens": sum(reasoning),
        "answer_tokens": tokens - sum(reasoning),
        "repeats": len(rates),
        "others_cpu": max(shares) if shares else None,
    }
    return row


def _stored_figures(cell: dict) -> dict:
    """A cell stored before issue 31: its metrics, each a median without an interval."""
    metrics = cell.get("metrics") or {}
    row = {name: metrics.get(name) for name in POINT_FIGURES}
    for name in ("decode_tok_s", "ttft_s"):
        value = metrics.get(name)
        row |= spread_fields(name, Spread(value, value, value, 1) if value is not None else None)
    row["repeats"] = metrics.get("requests")
    return row


def _row(cell: dict) -> dict:
    row = {
        "method": cell["cell"]["method"],
        "scenario": cell["cell"]["scenario"],
        "length": cell["cell"]["length"],
        **dict.fromkeys((*SPREAD_FIGURES, *POINT_FIGURES)),
        **{f"{n}_{end}": None for n in SPREAD_FIGURES for end in ("low", "high")},
        "skipped": cell.get("skipped"),
        "turns": turn_figures(cell),
    }
    figures = _sample_figures(cell) if cell.get("samples") else _stored_figures(cell)
    row |= figures
    row["disturbed"] = len(
        {s.get("repeat") for s in cell.get("samples") or [] if s.get("disturbed")}
    )
    return row


def _speedups(row: dict, cell: dict, ar_cell: dict | None) -> None:
    """The row's speedup over ar: paired by repeat when both have samples."""
    if ar_cell is None or row["decode_tok_s"] is None:
        return
    if cell.get("samples") and ar_cell.get("samples"):
        mine, base = repeat_figures(_clean(cell)), repeat_figures(_clean(ar_cell))
        ratios = paired_ratios(
            {r: f.rate for r, f in mine.items()}, {r: f.rate for r, f in base.items()}
        )
        row |= spread_fields("speedup", median_interval(ratios))
    else:
        base_rate = (ar_cell.get("metrics") or {}).get("decode_tok_s")
        ratio = row["decode_tok_s"] / base_rate if base_rate else None
        row |= spread_fields("speedup", Spread(ratio, ratio, ratio, 1) if ratio else None)


def rows_from_cells(cells: list[dict]) -> list[dict]:
    """One flat row per cell, every figure with its interval where it has one."""
    ar_cells = {
        (c["cell"]["scenario"], c["cell"]["length"]): c
        for c in cells
        if c["cell"]["method"] == BASELINE
    }
    rows = []
    for cell in cells:
        row = _row(cell)
        _speedups(row, cell, ar_cells.get((row["scenario"], row["length"])))
        rows.append(row)
    return sorted(rows, key=lambda r: (_column_order(r), _method_order(r["method"])))


def spread_of(row: dict, name: str) -> Spread | None:
    """The row's figure `name` as a Spread (n: the row's clean repeats)."""
    return spread_in(row, name, row.get("repeats") or 1)


def columns(rows: list[dict]) -> list[tuple[str, int]]:
    """The (scenario, length) pairs present, scenarios in SCENARIOS order, lengths ascending."""
    pairs = {(r["scenario"], r["length"]) for r in rows}
    return sorted(pairs, key=lambda pair: (SCENARIOS.index(pair[0]), pair[1]))


def methods(rows: list[dict]) -> list[str]:
    return sorted({r["method"] for r in rows}, key=_method_order)


def verdicts(rows: list[dict]) -> list[dict]:
    """Per (scenario, length): the verdict on the methods' speedups over ar."""
    found = []
    for scenario, length in columns(rows):
        column = [r for r in rows if (r["scenario"], r["length"]) == (scenario, length)]
        if not any(r["method"] == BASELINE and r["decode_tok_s"] for r in column):
            continue
        spreads = {r["method"]: spread_of(r, "speedup") for r in column}
        found.append({"scenario": scenario, "length": length, **verdict(spreads).to_json()})
    return found


# -- the agentic scenario's turns ----------------------------------------------------------------
def turn_figures(cell: dict) -> list[dict] | None:
    """Per turn of an agentic cell: prompt tokens, cached tokens and TTFT with the prefix cache
    on, and TTFT with it off (the same prompt re-sent with `cache_prompt: false`)."""
    if cell["cell"]["scenario"] != "agentic":
        return None
    by_turn: dict[int, dict[str, list[dict]]] = {}
    for entry in _clean(cell):
        modes = by_turn.setdefault(entry.get("turn", 0), {"on": [], "off": []})
        modes["off" if entry.get("cache") == CACHE_OFF else "on"].append(entry)
    turns = []
    for turn, modes in sorted(by_turn.items()):
        on, off = modes["on"], modes["off"]
        cached = [s["cached_tokens"] for s in on if s.get("cached_tokens") is not None]
        figures = {
            "turn": turn,
            "prompt_tokens": max((s["prompt_tokens"] for s in on), default=None),
        }
        figures["cached_tokens"] = statistics.median(cached) if cached else None
        for name, entries in (("ttft_on_s", on), ("ttft_off_s", off)):
            spread = median_interval(s["ttft_s"] for s in entries)
            figures[name] = spread.to_json() if spread else None
        turns.append(figures)
    return turns
