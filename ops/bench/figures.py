"""A stored run's figures, computed from its samples with the statistics of engine.bench_stats.

    by_repeat = repeat_figures(cell["samples"])      # {repeat: RepeatFigure(rate, tau, ...)}
    disturbed_methods(figures_by_method)             # which methods' speedups beat their tau
    rows = rows_from_cells(cells)                    # one row per cell, every figure with spread
    verdicts(rows)                                   # per scenario and length: winner or leaders

A repeat's rate is its decode tok/s over the cell's requests of that repeat (for the agentic
scenario: every turn with the prefix cache on, token-weighted); at a concurrency above 1 it is
the window's aggregate output tok/s instead (every request's tokens over first send -> last
end: what a server gives its N users together). A speedup pairs a method's repeat with ar's same
repeat (same prompt, same arrivals; in the agentic scenario the same transcript shape, one
session each). Samples of a disturbed repeat are kept in the cell, marked, and left out of
every figure. A cell stored before issue 31 (no samples) shows its stored metrics, no spread.

Serving figures (issue 37), every cell: aggregate output tok/s (with its interval over repeats),
requests/s and goodput (requests/s meeting the run's SLO) as medians over repeats, and TTFT,
TPOT and ITL (per token, ops/bench/client.py) at p50 / p90 / p99 over the clean requests.
With several servers each row of a later server has its rate and its TTFT p50 over the same
method's on the first server, paired by repeat (`vs_first`, `ttft_vs_first`), and
`server_verdicts` judges both (TTFT: the lowest wins).
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
from ops.bench.matrix import BENCH_METHODS, SCENARIOS, Slo, column_name, parse_method

BASELINE = "ar"
CACHE_OFF = "off"  # a sample's "cache" field: the agentic turn re-sent with the cache off
# With several servers, a row's figures over the same method's on the first server, paired by
# repeat: its rate (decode tok/s, or output tok/s above concurrency 1), and its TTFT p50.
SERVER_RATIOS = ("vs_first", "ttft_vs_first")
# Figures with a spread: the row has NAME (the median), NAME_low and NAME_high.
SPREAD_FIGURES = ("decode_tok_s", "speedup", "ttft_s", "output_tok_s", *SERVER_RATIOS)
PERCENTILES = (50, 90, 99)
LATENCIES = ("ttft", "tpot", "itl")
SERVING_FIGURES = (
    "requests_per_s",
    "goodput_rps",
    *(f"{name}_p{q}_s" for name in LATENCIES for q in PERCENTILES),
    "client_cpu",
)
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

    rate: float | None  # decode tok/s over the repeat's requests (at concurrency > 1: output)
    tau: float | None  # tokens committed per round over them (round-weighted)
    disturbed: bool
    output_tok_s: float | None = None  # every request's tokens / (first send -> last end)
    requests_per_s: float | None = None
    goodput_rps: float | None = None  # requests meeting the SLO a second (None: no SLO)
    ttft_p50_s: float | None = None  # the median TTFT of the repeat's requests


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


def _window_s(samples: list[Sample]) -> float:
    """First send -> last end of the requests (of one window, or of one turn's requests)."""
    return max(s.start_s + s.e2e_s for s in samples) - min(s.start_s for s in samples)


def repeat_figures(
    samples: Iterable[dict], concurrency: int = 1, slo: Slo | None = None
) -> dict[int, RepeatFigure]:
    """Each repeat's rate and tau (over its requests with the cache on), its serving figures,
    and whether the repeat was marked disturbed."""
    by_repeat: dict[int, list[dict]] = {}
    for entry in measured(samples):
        by_repeat.setdefault(entry.get("repeat", 0), []).append(entry)
    figures = {}
    for repeat, entries in sorted(by_repeat.items()):
        parsed = [Sample.from_json(e) for e in entries]
        disturbed = any(e.get("disturbed") for e in entries)
        seconds = sum(_window_s(turn) for turn in _windows(entries, parsed))
        output = _per_s(sum(s.completion_tokens for s in parsed), seconds)
        good = sum(slo.met_by(s.ttft_s, s.tpot_s) for s in parsed) if slo else None
        figures[repeat] = RepeatFigure(
            rate=output if concurrency > 1 else _rate(parsed),
            tau=_tau(parsed),
            disturbed=disturbed,
            output_tok_s=output,
            requests_per_s=_per_s(len(parsed), seconds),
            goodput_rps=None if good is None else _per_s(good, seconds),
            ttft_p50_s=statistics.median(s.ttft_s for s in parsed),
        )
    return figures


def _per_s(count: float, seconds: float) -> float | None:
    return count / seconds if seconds > 0 else None


def _windows(entries: list[dict], parsed: list[Sample]) -> list[list[Sample]]:
    """A repeat's requests by the window they were sent in (one window, or one per agentic
    turn): the windows' lengths add up to the time the repeat's load ran."""
    by_window: dict[int, list[Sample]] = {}
    for entry, sample in zip(entries, parsed, strict=True):
        by_window.setdefault(entry.get("turn", 0), []).append(sample)
    return list(by_window.values())


def disturbed_methods(by_method: dict[str, RepeatFigure]) -> dict[str, float]:
    """The methods of one repeat whose speedup over ar's same repeat exceeds their tau:
    {method: speedup}. Empty without an ar measurement."""
    rates = {method: figure.rate for method, figure in by_method.items()}
    taus = {method: figure.tau for method, figure in by_method.items()}
    return beyond_tau(rates, taus, BASELINE)


# -- rows ------------------------------------------------------------------------------------------
def _method_order(label: str) -> tuple[int, int]:
    method = parse_method(label)
    return BENCH_METHODS.index(method.name), method.budget or 0


def _column_order(row: dict) -> tuple[int, int, int]:
    return SCENARIOS.index(row["scenario"]), row["length"], row.get("concurrency", 1)


def basis_rate(row: dict) -> float | None:
    """What the row's speedup compares: decode tok/s one request at a time, the aggregate
    output tok/s at a concurrency above 1."""
    return row["decode_tok_s"] if row.get("concurrency", 1) == 1 else row.get("output_tok_s")


def column_of(row: dict) -> tuple[str, int, int]:
    """The row's (scenario, length, concurrency)."""
    return row["scenario"], row["length"], row.get("concurrency", 1)


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


def _concurrency(cell: dict) -> int:
    return cell["cell"].get("concurrency", 1)


def _slo(cell: dict) -> Slo | None:
    return Slo(**cell["slo"]) if cell.get("slo") else None


def _known(values: Iterable[float | None]) -> list[float]:
    return [v for v in values if v is not None]


def _median(values: Iterable[float | None]) -> float | None:
    known = _known(values)
    return statistics.median(known) if known else None


def serving_figures(samples: list[Sample], repeats: list[RepeatFigure]) -> dict:
    """Aggregate output tok/s (interval), requests/s and goodput (medians over repeats), and the
    latency percentiles over the requests."""
    values = {
        "ttft": [s.ttft_s for s in samples],
        "tpot": [s.tpot_s for s in samples if s.tpot_s is not None],
        "itl": [gap for s in samples for gap in s.itl_s or ()],
    }
    figures = spread_fields(
        "output_tok_s", median_interval(_known(r.output_tok_s for r in repeats))
    )
    figures["requests_per_s"] = _median(r.requests_per_s for r in repeats)
    figures["goodput_rps"] = _median(r.goodput_rps for r in repeats)
    for name, found in values.items():
        for q in PERCENTILES:
            figures[f"{name}_p{q}_s"] = percentile(found, q) if found else None
    return figures


def cell_repeats(cell: dict) -> dict[int, RepeatFigure]:
    """The figures of a cell's clean repeats, at its concurrency and under its SLO."""
    return repeat_figures(_clean(cell), _concurrency(cell), _slo(cell))


def _sample_figures(cell: dict) -> dict:
    """A cell's figures over its clean samples (the cache-on ones)."""
    clean = _clean(cell)
    samples = [Sample.from_json(s) for s in measured(clean)]
    if not samples:
        return {}
    repeats = list(cell_repeats(cell).values())
    rates = _known(f.rate for f in repeat_figures(clean).values())  # decode tok/s
    tokens = sum(s.completion_tokens for s in samples)
    reasoning = [s.reasoning_tokens for s in samples if s.reasoning_tokens is not None]
    shares = [s["others_cpu"] for s in clean if s.get("others_cpu") is not None]
    client_cpu = _known(s.get("client_cpu") for s in clean)
    row = summarize(samples) | serving_figures(samples, repeats)
    row |= spread_fields("decode_tok_s", median_interval(rates))
    row |= spread_fields("ttft_s", median_interval(s.ttft_s for s in samples))
    row |= {
        "reasoning_tokens": sum(reasoning),
        "answer_tokens": tokens - sum(reasoning),
        "repeats": len(rates),
        "others_cpu": max(shares) if shares else None,
        "client_cpu": max(client_cpu) if client_cpu else None,
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
        "concurrency": _concurrency(cell),
        "server": _server(cell["cell"]),
        **dict.fromkeys((*SPREAD_FIGURES, *POINT_FIGURES, *SERVING_FIGURES)),
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


# A repeat's figure, and a stored cell's metric of the same (a cell stored before issue 31).
PAIRED = {"rate": "decode_tok_s", "ttft_p50_s": "ttft_s"}


def _paired(cell: dict, base: dict | None, figure: str = "rate") -> Spread | None:
    """The cell's `figure` (a RepeatFigure field) over `base`'s, paired by repeat when both have
    samples (else the ratio of their stored metrics)."""
    if base is None:
        return None
    if cell.get("samples") and base.get("samples"):
        mine, theirs = cell_repeats(cell), cell_repeats(base)
        return median_interval(
            paired_ratios(
                {r: getattr(f, figure) for r, f in mine.items()},
                {r: getattr(f, figure) for r, f in theirs.items()},
            )
        )
    value, base_value = ((c.get("metrics") or {}).get(PAIRED[figure]) for c in (cell, base))
    ratio = value / base_value if value and base_value else None
    return Spread(ratio, ratio, ratio, 1) if ratio else None


def _server(cell_or_row: dict) -> int:
    return cell_or_row.get("server", 0)


def rows_from_cells(cells: list[dict]) -> list[dict]:
    """One flat row per cell, every figure with its interval where it has one: `speedup` over
    the same server's ar, and with several servers `vs_first` and `ttft_vs_first` (its rate
    and its TTFT p50 over the same method's on the first server) and a `label` naming the
    server."""
    by_key = {(column_of(c["cell"]), _server(c["cell"]), c["cell"]["method"]): c for c in cells}
    several = len({_server(c["cell"]) for c in cells}) > 1
    rows = []
    for cell in cells:
        row = _row(cell)
        where, server = column_of(row), _server(row)
        if row["decode_tok_s"] is not None:
            row |= spread_fields("speedup", _paired(cell, by_key.get((where, server, BASELINE))))
            if server:
                first = by_key.get((where, 0, row["method"]))
                row |= spread_fields("vs_first", _paired(cell, first))
                row |= spread_fields("ttft_vs_first", _paired(cell, first, "ttft_p50_s"))
        row["label"] = f"{row['method']} @s{server + 1}" if several else row["method"]
        rows.append(row)
    return sorted(rows, key=lambda r: (_column_order(r), _label_order(r)))


def _label_order(row: dict) -> tuple[int, int, int]:
    return (*_method_order(row["method"]), _server(row))


def spread_of(row: dict, name: str) -> Spread | None:
    """The row's figure `name` as a Spread (n: the row's clean repeats)."""
    return spread_in(row, name, row.get("repeats") or 1)


def columns(rows: list[dict]) -> list[tuple[str, int, int]]:
    """The (scenario, length, concurrency) columns present: scenarios in SCENARIOS order, then
    lengths and concurrency ascending."""
    found = {column_of(r) for r in rows}
    return sorted(found, key=lambda c: (SCENARIOS.index(c[0]), c[1], c[2]))


def methods(rows: list[dict]) -> list[str]:
    return sorted({r["method"] for r in rows}, key=_method_order)


def labels(rows: list[dict]) -> list[str]:
    """The rows' methods, each on each server (`ar @s2`) when several ran, in table order."""
    found = {r["label"]: _label_order(r) for r in rows}
    return sorted(found, key=found.get)


def verdicts(rows: list[dict]) -> list[dict]:
    """Per (scenario, length, concurrency) and server: the verdict on the methods' speedups
    over that server's ar."""
    found = []
    servers = sorted({_server(r) for r in rows})
    for scenario, length, level in columns(rows):
        for server in servers:
            column = [
                r
                for r in rows
                if column_of(r) == (scenario, length, level) and _server(r) == server
            ]
            if not any(r["method"] == BASELINE and r["decode_tok_s"] for r in column):
                continue
            spreads = {r["method"]: spread_of(r, "speedup") for r in column}
            where = {"scenario": scenario, "length": length, "concurrency": level}
            name = column_name(scenario, length, level)
            name += f" on s{server + 1}" if len(servers) > 1 else ""
            found.append({**where, "server": server, "column": name} | verdict(spreads).to_json())
    return found


def server_verdicts(rows: list[dict]) -> list[dict]:
    """With several servers, per column and method: which server was faster (each server's
    rate over the first's, paired by repeat), a winner only when its interval clears; and
    under `ttft_p50` which answered first (each server's TTFT p50 over the first's, paired by
    repeat: the lowest wins, only when its interval lies wholly below the others')."""
    if len({_server(r) for r in rows}) < 2:
        return []
    found = []
    for column in columns(rows):
        for method in methods(rows):
            same = [
                r for r in rows if column_of(r) == column and r["method"] == method and _server(r)
            ]
            rates = {f"s{_server(r) + 1}": spread_of(r, "vs_first") for r in same}
            if not any(rates.values()):
                continue
            ttfts = {f"s{_server(r) + 1}": spread_of(r, "ttft_vs_first") for r in same}
            first = verdict(ttfts, baseline="s1", lower_is_better=True).to_json()
            found.append(
                {"column": column_name(*column), "method": method}
                | verdict(rates, baseline="s1").to_json()
                | {"ttft_p50": first}
            )
    return found


# -- the agentic scenario's turns ----------------------------------------------------------------
def turn_figures(cell: dict) -> list[dict] | None:
    """Per turn of an agentic cell: prompt tokens, cached tokens and TTFT with the prefix cache
    on, and TTFT with it off (the same prompt re-sent with `cache_prompt: false`): the median
    with its interval and the p99, over the repeats and (at concurrency N) the N agents."""
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
        for name, entries in (("ttft_on", on), ("ttft_off", off)):
            spread = median_interval(s["ttft_s"] for s in entries)
            figures[f"{name}_s"] = spread.to_json() if spread else None
            figures[f"{name}_p99_s"] = percentile([s["ttft_s"] for s in entries], 99)
        turns.append(figures)
    return turns
