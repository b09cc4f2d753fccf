"""The bench report of a stored run: markdown tables, CSV, JSON and PNG plots.

    files = render_report(run_dir)       # writes report.md, results.csv, results.json, plots/*.png
    print(markdown_report(load_rows(run_dir)))

Rows are the run's finished cells with their figures and `speedup`: the cell's decode tok/s over
that of `ar` in the same scenario and length (None without an ar cell). The first table has one
row per method and one column per scenario and length (decode tok/s and speedup); the second
lists every figure. Plots (matplotlib, Agg): decode tok/s by method and length; tau and decode
tok/s by ddtree budget. `ddops bench report RUN_DIR` re-renders all of it from the stored cells.
"""

from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass
from pathlib import Path

from ops.bench.matrix import SCENARIOS, parse_method
from ops.bench.store import RunStore

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
    return ("ar", "linear", "ddtree").index(method.name), method.budget or 0


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
    """PNG plots of the measured rows: tok/s by method and length; tau and tok/s by budget."""
    import matplotlib

    matplotlib.use("Agg")
    measured = [r for r in rows if not r["skipped"] and r["decode_tok_s"]]
    if not measured:
        return []
    out_dir.mkdir(exist_ok=True)
    paths = [_plot_by_method(measured, out_dir / "tok_s_by_method_length.png")]
    if any(parse_method(r["method"]).budget for r in measured):
        paths.append(_plot_by_budget(measured, out_dir / "tau_tok_s_by_budget.png"))
    return paths


def _plot_by_method(rows: list[dict], path: Path) -> Path:
    import matplotlib.pyplot as plt

    columns, methods = _columns(rows), _methods(rows)
    rate = {(r["method"], r["scenario"], r["length"]): r["decode_tok_s"] for r in rows}
    width = 0.8 / len(methods)
    figure, axes = plt.subplots(figsize=(max(6, 1.6 * len(columns)), 4))
    for i, method in enumerate(methods):
        heights = [rate.get((method, s, n)) or 0 for s, n in columns]
        axes.bar([c + i * width for c in range(len(columns))], heights, width, label=method)
    axes.set_xticks([c + width * (len(methods) - 1) / 2 for c in range(len(columns))])
    axes.set_xticklabels([f"{s} {n}" for s, n in columns])
    axes.set_ylabel("decode tok/s")
    axes.set_title("decode tok/s by method and output length")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def _plot_by_budget(rows: list[dict], path: Path) -> Path:
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    figure, (tau_axes, rate_axes) = plt.subplots(1, 2, figsize=(10, 4))
    for scenario, length in _columns(rows):
        points = sorted(
            (
                (parse_method(r["method"]).budget, r)
                for r in rows
                if (r["scenario"], r["length"]) == (scenario, length)
                and parse_method(r["method"]).budget
            ),
            key=lambda point: point[0],
        )
        budgets = [b for b, _ in points]
        tau_axes.plot(
            budgets, [r["tau"] or 0 for _, r in points], "o-", label=f"{scenario} {length}"
        )
        rate_axes.plot(
            budgets, [r["decode_tok_s"] for _, r in points], "o-", label=f"{scenario} {length}"
        )
    for axes, label in ((tau_axes, "tau (tokens per round)"), (rate_axes, "decode tok/s")):
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
        axes.set_xlabel("ddtree budget (nodes)")
        axes.set_ylabel(label)
        axes.legend()
    figure.suptitle("ddtree: tau and decode tok/s by budget")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path
