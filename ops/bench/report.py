"""The bench report of a stored run: markdown tables, CSV, JSON and PNG plots.

    files = render_report(run_dir)       # writes report.md, results.csv, results.json, plots/*.png
    print(markdown_report(load_rows(run_dir)))

Rows are the run's finished cells with their figures and `speedup`: the cell's decode tok/s over
that of `ar` in the same scenario and length (None without an ar cell). The first table has one
row per method and one column per scenario and length (decode tok/s and speedup); the second
lists every figure. Plots (matplotlib, Agg), one question each: speedup over ar by method and
length (ar drawn at 1x); tau and decode tok/s by ddtree budget (ar and the DFlash chain drawn as
references). `ddops bench report RUN_DIR` re-renders all of it from the stored cells.
"""

from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass
from pathlib import Path

from ops.bench.matrix import SCENARIOS, parse_method
from ops.methods import METHODS
from ops.results import RunStore

METRICS = (
    "decode_tok_s",
    "e2e_tok_s",
    "ttft_s",
    "tpot_p50_s",
    "tpot_p90_s",
    "tau",
    "rounds",
    "completion_tokens",
    "requests",
)
CSV_FIELDS = ("method", "scenario", "length", *METRICS, "speedup", "skipped")


@dataclass(frozen=True)
class ReportFiles:
    markdown: Path
    csv: Path
    json: Path
    plots: tuple[Path, ...]


def _method_order(label: str) -> tuple[int, int]:
    method = parse_method(label)
    return METHODS.index(method.name), method.budget or 0


def _column_order(row: dict) -> tuple[int, int]:
    return SCENARIOS.index(row["scenario"]), row["length"]


def rows_from_cells(cells: list[dict]) -> list[dict]:
    """One flat row per cell (figures None when skipped), with its speedup over ar."""
    rows = []
    for cell in cells:
        metrics = cell.get("metrics") or {}
        rows.append(
            {
                "method": cell["cell"]["method"],
                "scenario": cell["cell"]["scenario"],
                "length": cell["cell"]["length"],
                **{name: metrics.get(name) for name in METRICS},
                "skipped": cell.get("skipped"),
            }
        )
    ar_rate = {(r["scenario"], r["length"]): r["decode_tok_s"] for r in rows if r["method"] == "ar"}
    for row in rows:
        base = ar_rate.get((row["scenario"], row["length"]))
        rate = row["decode_tok_s"]
        row["speedup"] = rate / base if rate and base else None
    return sorted(rows, key=lambda r: (_column_order(r), _method_order(r["method"])))


def load_rows(run_dir: Path) -> list[dict]:
    return rows_from_cells(RunStore.load(run_dir).cells())


def _number(value: float | None, digits: int, scale: float = 1.0, suffix: str = "") -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}{suffix}"


def _columns(rows: list[dict]) -> list[tuple[str, int]]:
    """The (scenario, length) pairs present, scenarios in SCENARIOS order, lengths ascending."""
    pairs = {(r["scenario"], r["length"]) for r in rows}
    return sorted(pairs, key=lambda pair: (SCENARIOS.index(pair[0]), pair[1]))


def _methods(rows: list[dict]) -> list[str]:
    return sorted({r["method"] for r in rows}, key=_method_order)


def _table(header: list[str], body: list[list[str]], right_from: int) -> list[str]:
    align = ["---" if i < right_from else "---:" for i in range(len(header))]
    return [
        "| " + " | ".join(header) + " |",
        "| " + " | ".join(align) + " |",
        *("| " + " | ".join(line) + " |" for line in body),
    ]


def summary_table(rows: list[dict]) -> list[str]:
    """Method x (scenario, length): decode tok/s and speedup vs ar."""
    columns = _columns(rows)
    by_key = {(r["method"], r["scenario"], r["length"]): r for r in rows}
    body = []
    for method in _methods(rows):
        line = [method]
        for scenario, length in columns:
            row = by_key.get((method, scenario, length))
            if row is None:
                line.append("-")
            elif row["skipped"]:
                line.append("skipped")
            elif row["decode_tok_s"] is None:
                line.append("-")
            else:
                speedup = _number(row["speedup"], 2, suffix="x")
                line.append(f"{_number(row['decode_tok_s'], 1)} ({speedup})")
        body.append(line)
    header = ["method", *(f"{scenario} {length}" for scenario, length in columns)]
    return _table(header, body, right_from=1)


def details_table(rows: list[dict]) -> list[str]:
    """Every figure of every cell; a skipped cell says why."""
    header = [
        "method",
        "scenario",
        "length",
        "decode tok/s",
        "e2e tok/s",
        "TTFT ms",
        "TPOT p50 ms",
        "TPOT p90 ms",
        "tau",
        "rounds",
        "speedup",
    ]
    body = []
    for r in rows:
        line = [r["method"], r["scenario"], str(r["length"])]
        if r["skipped"]:
            line += [f"skipped: {r['skipped']}"] + [""] * 7
        else:
            line += [
                _number(r["decode_tok_s"], 1),
                _number(r["e2e_tok_s"], 1),
                _number(r["ttft_s"], 1, 1000),
                _number(r["tpot_p50_s"], 2, 1000),
                _number(r["tpot_p90_s"], 2, 1000),
                _number(r["tau"], 2),
                _number(r["rounds"], 1),
                _number(r["speedup"], 2, suffix="x"),
            ]
        body.append(line)
    return _table(header, body, right_from=3)


def markdown_report(rows: list[dict], title: str = "ddops bench") -> str:
    lines = [
        f"# {title}",
        "",
        "## Decode tok/s (speedup vs ar of the same cell)",
        "",
        *summary_table(rows),
        "",
        "## All figures",
        "",
        *details_table(rows),
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
    markdown = run_dir / "report.md"
    markdown.write_text(markdown_report(rows, f"ddops bench {run_dir.name}"))
    table = run_dir / "results.csv"
    table.write_text(csv_text(rows))
    document = run_dir / "results.json"
    document.write_text(json.dumps({"run": store.manifest, "rows": rows}, indent=1) + "\n")
    return ReportFiles(markdown, table, document, tuple(plot(rows, run_dir / "plots")))


# -- plots ---------------------------------------------------------------------------------------
def plot(rows: list[dict], out_dir: Path) -> list[Path]:
    """PNG plots of the measured rows, one question each: how much faster than ar is each method
    at each output length; how tau and decode tok/s move with the ddtree budget."""
    import matplotlib

    matplotlib.use("Agg")
    measured = [r for r in rows if not r["skipped"] and r["decode_tok_s"]]
    if not measured:
        return []
    out_dir.mkdir(exist_ok=True)
    paths = []
    if any(r["speedup"] and r["method"] != "ar" for r in measured):
        paths.append(_plot_speedup(measured, out_dir / "speedup_by_method_length.png"))
    if any(parse_method(r["method"]).budget for r in measured):
        paths.append(_plot_by_budget(measured, out_dir / "tau_tok_s_by_budget.png"))
    return paths


def _plot_speedup(rows: list[dict], path: Path) -> Path:
    """Grouped bars: speedup over ar per method, one group per (scenario, length); ar at 1x."""
    import matplotlib.pyplot as plt

    columns = _columns(rows)
    methods = [m for m in _methods(rows) if m != "ar"]
    speedup = {(r["method"], r["scenario"], r["length"]): r["speedup"] for r in rows}
    ar_rate = {(r["scenario"], r["length"]): r["decode_tok_s"] for r in rows if r["method"] == "ar"}
    width = 0.8 / len(methods)
    figure, axes = plt.subplots(figsize=(max(7, 1.2 * len(columns) * len(methods) ** 0.5), 4.5))
    for i, method in enumerate(methods):
        xs = [c + (i - (len(methods) - 1) / 2) * width for c in range(len(columns))]
        heights = [speedup.get((method, s, n)) or 0 for s, n in columns]
        bars = axes.bar(xs, heights, width, label=method)
        axes.bar_label(bars, labels=[f"{h:.2f}x" if h else "" for h in heights], fontsize=7)
    axes.axhline(1.0, color="black", linestyle="--", linewidth=1, label="ar (baseline)")
    axes.set_xticks(range(len(columns)))
    axes.set_xticklabels(
        [f"{s} {n}\nar {ar_rate.get((s, n)) or 0:.1f} tok/s" for s, n in columns], fontsize=8
    )
    axes.set_xlabel("scenario and output length (new tokens)")
    axes.set_ylabel("speedup over ar (decode tok/s ratio, x)")
    axes.set_ylim(0, max(1.2, *(h or 0 for h in speedup.values())) * 1.15)
    axes.set_title("How much faster than autoregressive decoding, by method and length")
    axes.legend(fontsize=8, ncols=2)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def _plot_by_budget(rows: list[dict], path: Path) -> Path:
    """tau and decode tok/s against the ddtree budget, one colour per (scenario, length), with the
    same cell's ar (dashed) and DFlash chain (dotted) drawn as flat references."""
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    figure, (tau_axes, rate_axes) = plt.subplots(1, 2, figsize=(12, 4.5))
    budgets_seen: set[int] = set()
    handles = []
    for index, (scenario, length) in enumerate(_columns(rows)):
        cell = [r for r in rows if (r["scenario"], r["length"]) == (scenario, length)]
        points = sorted(
            (parse_method(r["method"]).budget, r) for r in cell if parse_method(r["method"]).budget
        )
        if not points:
            continue
        colour = f"C{index}"
        budgets = [b for b, _ in points]
        budgets_seen.update(budgets)
        tau_axes.plot(budgets, [r["tau"] or 0 for _, r in points], "o-", color=colour)
        rate_axes.plot(budgets, [r["decode_tok_s"] for _, r in points], "o-", color=colour)
        handles.append(Line2D([], [], color=colour, marker="o", label=f"{scenario} {length}"))
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
        (rate_axes, "decode tok/s (tokens per second)"),
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
