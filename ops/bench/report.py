"""The bench report of a stored run: markdown tables, CSV, JSON and PNG plots.

    files = render_report(run_dir)       # writes report.md, results.csv, results.json, plots/*.png
    print(markdown_report(load_rows(run_dir)))

Rows (ops/bench/figures.py) are the run's finished cells with every figure as its median over
clean repeats and, for decode tok/s, speedup and TTFT, an interval (`NAME_low`, `NAME_high`;
engine.bench_stats): `speedup` is the median of the paired ratios of a method's repeat to ar's
same repeat. The first table has one row per method and one column per scenario and length
(decode tok/s and speedup with its interval), then each column's verdict: a winner only when
its interval clears the others'. The second lists every figure; the agentic scenario adds its
turns (cached tokens, time to first token with the prefix cache on and off); the last section
says what the machine was doing. Plots (matplotlib, Agg), one question each, intervals as error
bars: speedup over ar by method and length (ar drawn at 1x); tau and decode tok/s by ddtree
budget (ar and the DFlash chain drawn as references); the agentic turns' time to first token,
cache on and off. `ddops bench report RUN_DIR` re-renders all of it from the stored cells.
"""

from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass
from pathlib import Path

from engine.bench_stats import Spread, counted, interval_name
from ops.bench.figures import (
    PERCENTILES,
    POINT_FIGURES,
    SERVING_FIGURES,
    SPREAD_FIGURES,
    basis_rate,
    column_of,
    columns,
    labels,
    rows_from_cells,
    server_verdicts,
    spread_of,
    verdicts,
)
from ops.bench.load import CLIENT_SATURATED
from ops.bench.matrix import column_name, parse_method
from ops.results import RunStore

CSV_FIELDS = (
    "method",
    "scenario",
    "length",
    "concurrency",
    "server",
    *(f"{name}{end}" for name in SPREAD_FIGURES for end in ("", "_low", "_high")),
    *POINT_FIGURES,
    *SERVING_FIGURES,
    "skipped",
)


@dataclass(frozen=True)
class ReportFiles:
    markdown: Path
    csv: Path
    json: Path
    plots: tuple[Path, ...]


def load_rows(run_dir: Path) -> list[dict]:
    return rows_from_cells(RunStore.load(run_dir).cells())


def run_servers(store: RunStore) -> list[dict]:
    """The run's servers as its manifest names them (url, model), each with the methods it
    answered that it decoded with (the responses' `speculative` field)."""
    servers = [dict(s) for s in (store.manifest.get("versions") or {}).get("servers") or []]
    for index, server in enumerate(servers):
        said = {
            sample["served"]
            for cell in store.cells()
            if cell["cell"].get("server", 0) == index
            for sample in cell.get("samples") or []
            if sample.get("served")
        }
        server["served"] = sorted(said)
    return servers


def _number(value: float | None, digits: int, scale: float = 1.0, suffix: str = "") -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}{suffix}"


def _spread(row: dict, name: str, digits: int = 2, scale: float = 1.0, suffix: str = "") -> str:
    spread = spread_of(row, name)
    return "-" if spread is None else spread.text(suffix, digits, scale)


def _interval(rows: list[dict]) -> str:
    """The intervals' name for a label: what the fewest repeats of `rows` give."""
    return interval_name(min((row.get("repeats") or 1 for row in rows), default=1))


def _table(header: list[str], body: list[list[str]], right_from: int) -> list[str]:
    align = ["---" if i < right_from else "---:" for i in range(len(header))]
    return [
        "| " + " | ".join(header) + " |",
        "| " + " | ".join(align) + " |",
        *("| " + " | ".join(line) + " |" for line in body),
    ]


def _not_measured(row: dict) -> str | None:
    if row["skipped"]:
        return "skipped"
    if row["decode_tok_s"] is None:
        return "disturbed" if row["disturbed"] else "-"
    return None


def summary_table(rows: list[dict]) -> list[str]:
    """Method x (scenario, length): decode tok/s and speedup vs ar with its interval."""
    by_key = {(r["label"], *column_of(r)): r for r in rows}
    body = []
    for label in labels(rows):
        line = [label]
        for column in columns(rows):
            row = by_key.get((label, *column))
            if row is None:
                line.append("-")
            elif missing := _not_measured(row):
                line.append(missing)
            else:
                line.append(
                    f"{_number(row['decode_tok_s'], 1)}, {_spread(row, 'speedup', suffix='x')}"
                )
        body.append(line)
    header = ["method", *(column_name(*column) for column in columns(rows))]
    return _table(header, body, right_from=1)


def verdict_lines(rows: list[dict]) -> list[str]:
    return [f"- {v['column']}: {v['text']}" for v in verdicts(rows)]


SERVERS_NOTE = (
    "Each server's figure over the same method's on s1, paired by repeat: decode tok/s at",
    "concurrency 1, output tok/s above it; TTFT p50 is a time, so below 1x answers sooner.",
)


def servers_lines(rows: list[dict], servers: list[dict] | None) -> list[str]:
    """With several servers: what each one is and answered, each server's rate and TTFT p50
    over the first's per method and column, and the verdicts on both (paired by repeat)."""
    found = server_verdicts(rows)
    if not found:
        return []
    lines = []
    for index, server in enumerate(servers or []):
        answered = ", ".join(server.get("served") or []) or "no `speculative` field"
        lines.append(
            f"- s{index + 1}: {server['url']}: model {server.get('model')}, answered {answered}"
        )
    ratios = [
        [r["label"], column_name(*column_of(r)), _spread(r, "vs_first", suffix="x"),
         _spread(r, "ttft_vs_first", suffix="x")]
        for r in rows
        if r["server"] and r["vs_first"] is not None
    ]  # fmt: skip
    header = ["method", "column", "tok/s vs s1", "TTFT p50 vs s1"]
    return [
        *lines,
        "",
        *SERVERS_NOTE,
        "",
        *_table(header, ratios, right_from=2),
        "",
        *(
            line
            for v in found
            for line in (
                f"- {v['column']}, {v['method']}: {v['text']}",
                f"- {v['column']}, {v['method']}, TTFT p50: {v['ttft_p50']['text']}",
            )
        ),
    ]


def details_table(rows: list[dict]) -> list[str]:
    """Every figure of every cell; a skipped cell says why. A `clients` column when some cell
    ran at a concurrency above 1."""
    several = any(r.get("concurrency", 1) != 1 for r in rows)
    header = [
        "method",
        "scenario",
        "length",
        *(["clients"] if several else []),
        "decode tok/s",
        "speedup",
        "TTFT ms",
        "e2e tok/s",
        "TPOT p50 ms",
        "TPOT p90 ms",
        "tau",
        "think / answer tokens",
        "repeats (disturbed)",
        "others' CPU",
    ]
    body = []
    for r in rows:
        line = [r["label"], r["scenario"], str(r["length"])]
        line += [str(r["concurrency"])] if several else []
        if r["skipped"]:
            line += [f"skipped: {r['skipped']}"] + [""] * (len(header) - len(line) - 1)
        else:
            thought = r["reasoning_tokens"]
            line += [
                _spread(r, "decode_tok_s", 1),
                _spread(r, "speedup", suffix="x"),
                _spread(r, "ttft_s", 1, 1000),
                _number(r["e2e_tok_s"], 1),
                _number(r["tpot_p50_s"], 2, 1000),
                _number(r["tpot_p90_s"], 2, 1000),
                _number(r["tau"], 2),
                f"{thought} / {r['answer_tokens']}" if thought is not None else "-",
                f"{r['repeats'] or 0} ({r['disturbed']})",
                _number(r["others_cpu"], 0, 100, "%"),
            ]
        body.append(line)
    return _table(header, body, right_from=4 if several else 3)


def _percentiles(row: dict, name: str) -> str:
    values = [row[f"{name}_p{q}_s"] for q in PERCENTILES]
    return "-" if values[0] is None else " / ".join(f"{1000 * v:.1f}" for v in values)


def serving_table(rows: list[dict]) -> list[str]:
    """Per cell: aggregate output tok/s (interval), requests/s, goodput, and TTFT / TPOT / ITL
    at p50 / p90 / p99; the bench's own CPU."""
    served = [r for r in rows if r.get("output_tok_s") is not None]
    if not served:
        return []
    quantiles = "p" + " / p".join(map(str, PERCENTILES))
    header = [
        "method",
        "column",
        "output tok/s",
        "req/s",
        "goodput req/s",
        f"TTFT ms {quantiles}",
        f"TPOT ms {quantiles}",
        f"ITL ms {quantiles}",
        "client CPU",
    ]
    body = [
        [
            r["label"],
            column_name(*column_of(r)),
            _spread(r, "output_tok_s", 1),
            _number(r["requests_per_s"], 2),
            _number(r["goodput_rps"], 2),
            _percentiles(r, "ttft"),
            _percentiles(r, "tpot"),
            _percentiles(r, "itl"),
            _number(r["client_cpu"], 0, 100, "%"),
        ]
        for r in served  # rows_from_cells' order: by column, then method
    ]
    lines = _table(header, body, right_from=2)
    busiest = max((r["client_cpu"] or 0 for r in served), default=0)
    if busiest > CLIENT_SATURATED:
        lines += [
            "",
            f"WARNING: the bench's client used {busiest:.0%} of a core in a window (one event",
            "loop: one core at most): it may have set the pace, not the server.",
        ]
    return lines


def turns_table(rows: list[dict]) -> list[str]:
    """The agentic cells' turns: prompt and cached tokens, TTFT with the prefix cache on and off;
    with several agents at once (a concurrency above 1) their number and the p99s too."""
    agents = any(r.get("turns") and r.get("concurrency", 1) > 1 for r in rows)
    header = [
        "method",
        "length",
        *(["agents"] if agents else []),
        "turn",
        "prompt tokens",
        "cached",
        "TTFT ms cache on",
        "TTFT ms cache off",
        *(["p99 on / off ms"] if agents else []),
    ]
    body = []
    for r in rows:
        for turn in r.get("turns") or []:
            on, off = (Spread.from_json(turn[k]) for k in ("ttft_on_s", "ttft_off_s"))
            p99 = [turn.get(k) for k in ("ttft_on_p99_s", "ttft_off_p99_s")]
            body.append(
                [
                    r["label"],
                    str(r["length"]),
                    *([str(r["concurrency"])] if agents else []),
                    str(turn["turn"] + 1),
                    str(turn["prompt_tokens"]),
                    "-" if turn["cached_tokens"] is None else f"{turn['cached_tokens']:.0f}",
                    on.text("", 1, 1000) if on else "-",
                    off.text("", 1, 1000) if off else "-",
                    *([" / ".join(_number(v, 1, 1000) for v in p99)] if agents else []),
                ]
            )
    return _table(header, body, right_from=3 if agents else 2) if body else []


def machine_lines(machine: dict | None) -> list[str]:
    """What the machine was doing during the run, in words."""
    if not machine:
        return ["not recorded"]
    lines = []
    if machine.get("cpus"):
        loads = [
            f"{load[0]:.1f}"
            for load in (machine.get("load_start"), machine.get("load_end"))
            if load
        ]
        lines.append(f"- {machine['cpus']} CPUs, load average (1 min) {' -> '.join(loads) or '-'}")
    if machine.get("others_cpu") is not None:
        own = machine.get("own_cpu")
        mine = f"; the bench and the engine {own:.0%}" if own is not None else ""
        lines.append(f"- other processes used {machine['others_cpu']:.0%} of the CPU{mine}")
    for gpu in machine.get("gpus") or []:
        clocks = f"{_number(gpu['sm_mhz_min'], 0)}-{_number(gpu['sm_mhz_max'], 0)}"
        lines.append(
            f"- GPU {gpu['index']}: SM {clocks} MHz of {_number(gpu['sm_max_mhz'], 0)}, "
            f"memory {_number(gpu['mem_mhz'], 0)} MHz, up to {_number(gpu['temperature_c_max'], 0)} C"
        )
    if machine.get("gpu_processes") is not None:
        names = ", ".join(f"{p['name']} ({p['pid']})" for p in machine["gpu_processes"]) or "none"
        lines.append(f"- processes on the GPUs: {names}")
    disturbed = counted(machine.get("disturbed_repeats", 0), "repeat")
    lines.append(f"- {disturbed} disturbed (speedup above tau)")
    if machine.get("warning"):
        lines.append(f"- WARNING: {machine['warning']}")
    return lines


SERVING_NOTE = (
    "Output tok/s: every request's tokens over the window (first send -> last end), median over",
    "repeats; at concurrency 1 the speedup compares decode tok/s, above it output tok/s. ITL is",
    "per token: the tokens of one streamed chunk (a speculative round) arrive together.",
)


def markdown_report(
    rows: list[dict],
    title: str = "ddops bench",
    machine: dict | None = None,
    servers: list[dict] | None = None,
) -> str:
    turns, serving = turns_table(rows), serving_table(rows)
    side_by_side = servers_lines(rows, servers)
    lines = [
        f"# {title}",
        "",
        f"## Decode tok/s, speedup vs ar: median of paired repeats, {_interval(rows)}",
        "",
        *summary_table(rows),
        "",
        *verdict_lines(rows),
        "",
        *(["## Servers side by side", "", *side_by_side, ""] if side_by_side else []),
        "## All figures",
        "",
        "Decode tok/s counts every generated token, reasoning (`<think>`) included; TTFT",
        "includes any wait in the engine's queue.",
        "",
        *details_table(rows),
        "",
        *(
            ["## Serving: throughput and latency", "", *SERVING_NOTE, "", *serving, ""]
            if serving
            else []
        ),
        *(["## Agentic turns (prefix cache on and off)", "", *turns, ""] if turns else []),
        "## The machine during the run",
        "",
        *machine_lines(machine),
        "",
    ]
    return "\n".join(lines)


def csv_text(rows: list[dict]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, CSV_FIELDS, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({name: "" if row[name] is None else row[name] for name in CSV_FIELDS})
    return out.getvalue()


def render_report(run_dir: Path) -> ReportFiles:
    """Write the report files of a stored run into it; returns their paths."""
    run_dir = Path(run_dir)
    store = RunStore.load(run_dir)
    rows = rows_from_cells(store.cells())
    machine = store.manifest.get("machine")
    servers = run_servers(store)
    markdown = run_dir / "report.md"
    markdown.write_text(markdown_report(rows, f"ddops bench {run_dir.name}", machine, servers))
    table = run_dir / "results.csv"
    table.write_text(csv_text(rows))
    document = run_dir / "results.json"
    body = {"run": store.manifest, "rows": rows, "verdicts": verdicts(rows), "machine": machine}
    body |= {"servers": servers, "server_verdicts": server_verdicts(rows)}
    document.write_text(json.dumps(body, indent=1) + "\n")
    return ReportFiles(markdown, table, document, tuple(plot(rows, run_dir / "plots")))


# -- plots ---------------------------------------------------------------------------------------
def plot(rows: list[dict], out_dir: Path) -> list[Path]:
    """PNG plots of the measured rows, one question each: how much faster than ar is each method
    at each output length; how tau and decode tok/s move with the ddtree budget; how long the
    agentic turns wait for their first token with the prefix cache and without; how throughput
    grows with concurrency; what latency each throughput costs."""
    import matplotlib

    matplotlib.use("Agg")
    measured = [r for r in rows if not r["skipped"] and r["decode_tok_s"]]
    if not measured:
        return []
    out_dir.mkdir(exist_ok=True)
    paths = []
    if any(r["speedup"] and r["method"] != "ar" for r in measured):
        paths.append(_plot_speedup(measured, out_dir / "speedup_by_method_length.png"))
    first = [r for r in measured if not r["server"]]  # the budget curve: the first server's
    if any(parse_method(r["method"]).budget for r in first):
        paths.append(_plot_by_budget(first, out_dir / "tau_tok_s_by_budget.png"))
    if any(r.get("turns") for r in measured):
        paths.append(_plot_turns(measured, out_dir / "agentic_ttft_by_turn.png"))
    served = [r for r in measured if r.get("output_tok_s")]
    if len({r["concurrency"] for r in served}) > 1:  # curves need more than one level
        paths.append(_plot_throughput(served, out_dir / "throughput_by_concurrency.png"))
        paths.append(_plot_latency(served, out_dir / "latency_by_throughput.png"))
    return paths


def _series(rows: list[dict]) -> dict[tuple[str, str, int], list[dict]]:
    """Rows by (method, scenario, length), each list by concurrency: one curve each."""
    curves: dict[tuple[str, str, int], list[dict]] = {}
    for row in sorted(rows, key=lambda r: r["concurrency"]):
        curves.setdefault((row["label"], row["scenario"], row["length"]), []).append(row)
    return curves


def _curve_label(key: tuple[str, str, int], rows: list[dict]) -> str:
    method, scenario, length = key
    several = len({(r["scenario"], r["length"]) for r in rows}) > 1
    return f"{method} ({scenario} {length})" if several else method


def _plot_throughput(rows: list[dict], path: Path) -> Path:
    """Aggregate output tok/s against concurrency, one line per method (and scenario, length),
    with each point's interval over repeats as an error bar."""
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 4.5))
    levels = sorted({r["concurrency"] for r in rows})
    for index, (key, curve) in enumerate(_series(rows).items()):
        axes.errorbar(
            [r["concurrency"] for r in curve],
            [r["output_tok_s"] for r in curve],
            yerr=_error_bars(curve, "output_tok_s"),
            fmt="o-",
            color=f"C{index}",
            capsize=3,
            label=_curve_label(key, rows),
        )
    axes.set_xscale("log", base=2)
    axes.set_xticks(levels, [str(level) for level in levels])
    axes.minorticks_off()
    axes.set_xlabel("concurrent clients (closed loop)")
    axes.set_ylabel(f"aggregate output tok/s (median, {_interval(rows)})")
    axes.set_ylim(bottom=0)
    axes.set_title("Throughput against concurrency")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def _plot_latency(rows: list[dict], path: Path) -> Path:
    """TTFT and ITL at p50 (solid) and p99 (dashed) against aggregate output tok/s, one colour
    per method (and scenario, length), one point per concurrency (labelled): the curve serving
    comparisons show."""
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    figure, panels = plt.subplots(1, 2, figsize=(12, 4.5))
    handles = []
    for index, (key, curve) in enumerate(_series(rows).items()):
        xs = [r["output_tok_s"] for r in curve]
        for axes, name in zip(panels, ("ttft", "itl"), strict=True):
            for q, style in ((50, "o-"), (99, "s--")):
                ys = [1000 * (r[f"{name}_p{q}_s"] or 0) for r in curve]
                axes.plot(xs, ys, style, color=f"C{index}")
            for row, x in zip(curve, xs, strict=True):
                axes.annotate(f"c{row['concurrency']}", (x, 1000 * (row[f"{name}_p99_s"] or 0)),
                              fontsize=7, textcoords="offset points", xytext=(3, 3))  # fmt: skip
        handles.append(Line2D([], [], color=f"C{index}", marker="o", label=_curve_label(key, rows)))
    handles += [
        Line2D([], [], color="grey", marker="o", label="p50"),
        Line2D([], [], color="grey", marker="s", linestyle="--", label="p99"),
    ]
    for axes, what in zip(panels, ("time to first token", "inter-token latency"), strict=True):
        axes.set_xlabel("aggregate output tok/s")
        axes.set_ylabel(f"{what}, ms")
        axes.set_ylim(bottom=0)
        axes.set_title(f"{what[0].upper()}{what[1:]} against throughput")
        axes.grid(alpha=0.3)
    panels[1].legend(handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1))
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def _error_bars(rows: list[dict | None], name: str) -> list[list[float]]:
    """matplotlib's yerr (distances below and above the median) of each row's interval."""
    below, above = [], []
    for row in rows:
        spread = spread_of(row, name) if row else None
        below.append(spread.median - spread.low if spread else 0.0)
        above.append(spread.high - spread.median if spread else 0.0)
    return [below, above]


def _plot_speedup(rows: list[dict], path: Path) -> Path:
    """Grouped bars: speedup over ar per method, one group per (scenario, length), each with its
    interval as an error bar; ar at 1x."""
    import matplotlib.pyplot as plt

    pairs = columns(rows)
    rivals = [label for label in labels(rows) if label != "ar"]
    by_key = {(r["label"], *column_of(r)): r for r in rows}
    ar_rate = {column_of(r): basis_rate(r) for r in rows if r["label"] == "ar"}
    width = 0.8 / len(rivals)
    figure, axes = plt.subplots(figsize=(max(7, 1.2 * len(pairs) * len(rivals) ** 0.5), 4.5))
    top = 1.2
    for i, method in enumerate(rivals):
        xs = [c + (i - (len(rivals) - 1) / 2) * width for c in range(len(pairs))]
        cells = [by_key.get((method, *column)) for column in pairs]
        heights = [(c or {}).get("speedup") or 0 for c in cells]
        errors = _error_bars(cells, "speedup")
        axes.bar(xs, heights, width, label=method, yerr=errors, capsize=3)
        for x, height, above in zip(xs, heights, errors[1], strict=True):
            if height:
                axes.text(x, height + above, f"{height:.2f}x", ha="center", va="bottom", fontsize=7)
        top = max(top, *(h + e for h, e in zip(heights, errors[1], strict=True)))
    axes.axhline(1.0, color="black", linestyle="--", linewidth=1, label="ar (baseline)")
    axes.set_xticks(range(len(pairs)))
    axes.set_xticklabels(
        [f"{column_name(*c)}\nar {ar_rate.get(c) or 0:.1f} tok/s" for c in pairs], fontsize=8
    )
    axes.set_xlabel("scenario and output length (new tokens)")
    axes.set_ylabel("speedup over ar (paired decode tok/s ratio, x)")
    axes.set_ylim(0, top * 1.15)
    axes.set_title(f"Speedup over autoregressive decoding: median, {_interval(rows)}")
    axes.legend(fontsize=8, ncols=2)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def _plot_by_budget(rows: list[dict], path: Path) -> Path:
    """tau and decode tok/s (with its interval) against the ddtree budget, one colour per
    (scenario, length), with the same cell's ar (dashed) and DFlash chain (dotted) drawn as flat
    references."""
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    figure, (tau_axes, rate_axes) = plt.subplots(1, 2, figsize=(12, 4.5))
    budgets_seen: set[int] = set()
    handles = []
    for index, column in enumerate(columns(rows)):
        cell = [r for r in rows if column_of(r) == column]
        points = sorted(
            (parse_method(r["method"]).budget, r) for r in cell if parse_method(r["method"]).budget
        )
        if not points:
            continue
        colour = f"C{index}"
        budgets = [b for b, _ in points]
        budgets_seen.update(budgets)
        tau_axes.plot(budgets, [r["tau"] or 0 for _, r in points], "o-", color=colour)
        rate_axes.errorbar(
            budgets,
            [r["decode_tok_s"] for _, r in points],
            yerr=_error_bars([r for _, r in points], "decode_tok_s"),
            fmt="o-",
            color=colour,
            capsize=3,
        )
        handles.append(Line2D([], [], color=colour, marker="o", label=column_name(*column)))
        for method, style in (("ar", "--"), ("linear", ":")):
            ref = next((r for r in cell if r["method"] == method), None)
            if ref is not None:
                tau_axes.axhline(ref["tau"] or 0, color=colour, linestyle=style, linewidth=1)
                rate_axes.axhline(ref["decode_tok_s"], color=colour, linestyle=style, linewidth=1)
    handles += [
        Line2D([], [], color="grey", marker="o", label="ddtree"),
        Line2D([], [], color="grey", linestyle=":", label="DFlash chain (linear)"),
        Line2D([], [], color="grey", linestyle="--", label="ar (baseline)"),
    ]
    for axes, label in (
        (tau_axes, "tau (tokens committed per round)"),
        (rate_axes, f"decode tok/s (median, {_interval(rows)})"),
    ):
        axes.set_xscale("log", base=2)
        axes.set_xticks(sorted(budgets_seen), [str(b) for b in sorted(budgets_seen)])
        axes.minorticks_off()
        axes.set_xlabel("ddtree budget (draft tree nodes, log scale)")
        axes.set_ylabel(label)
        axes.set_ylim(bottom=0)
        axes.grid(alpha=0.3)
    tau_axes.set_title("Tokens per round by budget")
    rate_axes.set_title("Decode speed by budget")
    rate_axes.legend(handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1))
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def _plot_turns(rows: list[dict], path: Path) -> Path:
    """Time to first token per agentic turn, prefix cache on (solid) and off (dashed), one colour
    per method, with intervals; the longest output length measured (the others look alike)."""
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    agentic = [r for r in rows if r.get("turns")]
    longest = max(r["length"] for r in agentic)
    figure, axes = plt.subplots(figsize=(9, 4.5))
    handles = []
    for index, row in enumerate(r for r in agentic if r["length"] == longest):
        turns = row["turns"]
        xs = [t["turn"] + 1 for t in turns]
        for key, style in (("ttft_on_s", "o-"), ("ttft_off_s", "s--")):
            spreads = [Spread.from_json(t[key]) for t in turns]
            ys = [1000 * s.median if s else 0 for s in spreads]
            errors = [
                [1000 * (s.median - s.low) if s else 0 for s in spreads],
                [1000 * (s.high - s.median) if s else 0 for s in spreads],
            ]
            axes.errorbar(xs, ys, yerr=errors, fmt=style, color=f"C{index}", capsize=3)
        handles.append(Line2D([], [], color=f"C{index}", marker="o", label=row["label"]))
        axes.set_xticks(xs)
    handles += [
        Line2D([], [], color="grey", marker="o", label="prefix cache on"),
        Line2D([], [], color="grey", marker="s", linestyle="--", label="cache off"),
    ]
    axes.set_xlabel(f"agent turn (the conversation grows each turn; {longest} new tokens a turn)")
    axes.set_ylabel(f"time to first token, ms (median, {_interval(agentic)})")
    axes.set_ylim(bottom=0)
    axes.set_title("Agentic turns: time to first token with the prefix cache on and off")
    axes.grid(alpha=0.3)
    axes.legend(handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1))
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
