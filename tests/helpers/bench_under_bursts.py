"""The busy-machine check of issues 31 and 37: the demo's bench on the demo pair, once as the
machine is and then (--burst-runs) times while burst_load.py takes the cores in bursts; then
each run's ddtree:15 / ar speedup at each length beside the quiet one (within --tolerance?) and
every reported speedup against its tau. A dev tool (not shipped): the closing note's figures
come from it. On a quiet machine only: the quiet run is the reference (with --alternate, the
quiet runs either side of each run under bursts: the host's own speed drifts between runs).

    python -m tests.helpers.bench_under_bursts --out /tmp/i31/check            # both runs
    python -m tests.helpers.bench_under_bursts --out DIR --runs quiet          # one of them
    # issue 37, Must 8: 5 runs under 2 s on / 2 s off bursts, each within 15% of quiet
    python -m tests.helpers.bench_under_bursts --out DIR --methods ar,ddtree:15 \
        --lengths 128,256 --burst-runs 5 --burst-on 2 --burst-off 2 --tolerance 0.15
    # the same at 256 tokens with a budget that buys ~9+ clean repeats under bursts
    python -m tests.helpers.bench_under_bursts --out DIR --methods ar,ddtree:15 \
        --lengths 256 --burst-runs 3 --burst-on 2 --burst-off 2 --tolerance 0.15 --time-budget 300
    # each run under bursts beside the quiet runs just before and after it (the host drifts)
    python -m tests.helpers.bench_under_bursts --out DIR --methods ar,ddtree:15 \
        --lengths 128,256 --burst-runs 5 --burst-on 2 --burst-off 2 --tolerance 0.15 --alternate

It serves the demo pair with `python -m engine serve` (--threads torch threads: 2, as the demo's
2-core CT gives it), runs `ddops bench --url` with the demo's bench options (ops/demo_story.py:
methods, length, repeats, time budget; --time-budget another) and prints each run's table,
verdict and machine warning, then the comparison. The burst load: --burst-workers processes,
--burst-on / --burst-off seconds.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from ops.bench.figures import rows_from_cells
from ops.demo_story import BENCH_BUDGET_S, BENCH_LENGTHS, BENCH_METHODS, BENCH_REPEATS
from ops.results import RunStore
from tests.helpers.conversations import DEMO_TARGET
from tests.helpers.engine_server import start_engine_server

TOLERANCE = 0.35
SLACK = 1.10
SPED_UP = "ddtree:15"


def bench_argv(url: str, out: Path, args: argparse.Namespace) -> list[str]:
    return [
        *(sys.executable, "-m", "ops.cli", "--json", "bench", "--url", url, "--out", str(out)),
        *("--methods", args.methods, "--lengths", args.lengths, "--repeats", BENCH_REPEATS),
        *("--time-budget", str(args.time_budget)),
    ]


def run_bench(url: str, out: Path, args: argparse.Namespace, bursts: bool) -> dict:
    load = None
    if bursts:
        load = subprocess.Popen(
            [sys.executable, "-m", "tests.helpers.burst_load", "--workers", str(args.burst_workers),
             "--on", str(args.burst_on), "--off", str(args.burst_off), "--seconds", "3600"]
        )  # fmt: skip
    try:
        argv = bench_argv(url, out, args)
        done = subprocess.run(argv, capture_output=True, text=True, check=True)
    finally:
        if load is not None:
            load.terminate()
            load.wait()
    return json.loads(done.stdout)


def speedups(document: dict) -> dict[tuple[str, int], dict]:
    """The run's rows by (method, length)."""
    cells = RunStore.load(Path(document["run_dir"])).cells()
    return {(row["method"], row["length"]): row for row in rows_from_cells(cells)}


def show(name: str, document: dict) -> None:
    rows = speedups(document)
    print(f"\n== {name}: {document['run_dir']}")
    print(
        f"  {'method':<10} {'length':>6} {'tau':>5} {'tok/s':>8}  speedup (interval)  repeats (disturbed)"
    )
    for (method, length), row in rows.items():
        if row["speedup"] is None:
            print(f"  {method:<10} {length:>6} left out: {row['disturbed']} repeats disturbed")
            continue
        interval = f"{row['speedup']:.2f}x ({row['speedup_low']:.2f}-{row['speedup_high']:.2f})"
        print(
            f"  {method:<10} {length:>6} {row['tau']:>5.2f} {row['decode_tok_s']:>8.1f}  "
            f"{interval:<22} {row['repeats']} ({row['disturbed']})"
        )
    for found in document["verdicts"]:
        print(f"  verdict: {found['text']}")
    machine = document["machine"]
    print(f"  machine: others' CPU {machine.get('others_cpu')}, load {machine.get('load_end')}")
    print(f"  warning: {machine.get('warning')}")


def quiet_speedups(*quiet: dict) -> dict[tuple[str, int], float]:
    """ddtree:15 / ar of quiet runs by (method, length): one run's, or the mean of the two
    quiet runs either side of a run under bursts (--alternate)."""
    rows = [speedups(document) for document in quiet]
    return {key: sum(r[key]["speedup"] for r in rows) / len(rows) for key in rows[0]}


def compare(quiet: dict[tuple[str, int], float], busy: dict, name: str, tolerance: float) -> bool:
    """Each length's ddtree:15 / ar under bursts beside quiet (`quiet_speedups`); whether
    every one is within `tolerance` of quiet (a figure left out as disturbed is reported,
    never wrong)."""
    held = True
    for (method, length), row in speedups(busy).items():
        if method != SPED_UP:
            continue
        a, b = quiet[(method, length)], row["speedup"]
        if b is None:
            print(f"{name}: {method} / ar at {length}: {a:.2f}x quiet, left out under bursts")
            continue
        apart = abs(b - a) / a
        held &= apart <= tolerance
        verdict = "within" if apart <= tolerance else "NOT within"
        print(f"{name}: {method} / ar at {length}: {a:.2f}x quiet, {b:.2f}x under bursts: "
              f"{apart:.0%} apart ({verdict} {tolerance:.0%})")  # fmt: skip
    return held


def show_above_tau(name: str, document: dict) -> None:
    """The run's speedups above their tau (+10%): none can be real (see ops/README.md)."""
    above = [
        f"{m}@{n} {r['speedup']:.2f}x > tau {r['tau']:.2f}"
        for (m, n), r in speedups(document).items()
        if r["speedup"] is not None and r["speedup"] > r["tau"] * SLACK
    ]
    print(f"{name}: speedups above tau (+10%): {', '.join(above) or 'none'}")


def show_quiet_drift(quiet: list[dict]) -> None:
    """How far ddtree:15 / ar moved from each quiet run to the next (the floor under any
    tolerance: the gate cannot make a run under bursts closer to quiet than quiet is to itself)."""
    rows = [speedups(document) for document in quiet]
    for key in [k for k in rows[0] if k[0] == SPED_UP]:
        figures = [r[key]["speedup"] for r in rows]
        moves = [abs(b / a - 1) for a, b in zip(figures, figures[1:], strict=False)]
        shown = ", ".join(f"{f:.2f}x" for f in figures)
        print(f"quiet {key[0]} / ar at {key[1]}: {shown}; neighbours up to {max(moves):.0%} apart")


def run_names(runs: str, burst_runs: int, alternate: bool) -> list[str]:
    """The runs in the order they are measured: quiet first, or with `alternate` a quiet run
    before and after each run under bursts (quiet1, bursts1, quiet2, ...)."""
    bursts = [f"bursts{i + 1}" if burst_runs > 1 else "bursts" for i in range(burst_runs)]
    if alternate:
        return [name for i, b in enumerate(bursts) for name in (f"quiet{i + 1}", b)] + [
            f"quiet{burst_runs + 1}"
        ]
    return {"both": ["quiet", *bursts], "quiet": ["quiet"], "bursts": bursts}[runs]


def references(names: list[str], documents: dict) -> dict[str, list[dict]]:
    """Each run under bursts and the quiet runs it is compared with: its neighbours when the
    runs alternate, else the one quiet run."""
    found = {}
    for i, name in enumerate(names):
        if name.startswith("bursts"):
            around = [n for n in names[max(0, i - 1) : i + 2] if n.startswith("quiet")]
            quiet = around if len(around) == 2 else ["quiet"]
            if all(n in documents for n in quiet) and name in documents:
                found[name] = [documents[n] for n in quiet]
    return found


def held_everywhere(names: list[str], documents: dict, tolerance: float, alternate: bool) -> bool:
    """Print every run's check and the comparisons; whether every run under bursts was within
    `tolerance` of its quiet reference at every length."""
    for name in names:
        if name in documents:
            show_above_tau(name, documents[name])
    compared = references(names, documents)
    held = [
        compare(quiet_speedups(*quiet), documents[name], name, tolerance)
        for name, quiet in compared.items()
    ]
    if alternate:
        show_quiet_drift([documents[n] for n in names if n.startswith("quiet")])
    where = "its neighbouring quiet runs" if alternate else "quiet"
    print(
        f"\n{sum(held)} of {len(held)} runs under bursts within {tolerance:.0%} of {where} at every length"
    )
    return all(held)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--runs", choices=("both", "quiet", "bursts"), default="both")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--burst-workers", type=int, default=2)
    parser.add_argument("--burst-on", type=float, default=1.5)
    parser.add_argument("--burst-off", type=float, default=1.5)
    parser.add_argument("--burst-runs", type=int, default=1, help="runs under bursts")
    parser.add_argument("--methods", default=BENCH_METHODS)
    parser.add_argument("--lengths", default=BENCH_LENGTHS)
    parser.add_argument("--tolerance", type=float, default=TOLERANCE, help="of the quiet speedup")
    parser.add_argument(
        "--alternate",
        action="store_true",
        help="a quiet run before and after each run under bursts, each compared with its two",
    )
    parser.add_argument(
        "--time-budget", type=float, default=float(BENCH_BUDGET_S), help="each run's, seconds"
    )
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    server = start_engine_server(
        DEMO_TARGET,
        DEMO_TARGET.parent / "draft",
        extra_args=["--max-model-len", "2048", "--budget", "15"],
        log_path=args.out / "serve.log",
        cpu_threads=args.threads,
    )
    names = run_names(args.runs, args.burst_runs, args.alternate)
    documents = {}
    try:
        for name in names:
            bursts = name.startswith("bursts")
            documents[name] = run_bench(server.url, args.out / name, args, bursts)
            (args.out / f"{name}.json").write_text(json.dumps(documents[name], indent=1))
            show(name, documents[name])
    finally:
        server.stop()
    return 0 if held_everywhere(names, documents, args.tolerance, args.alternate) else 1


if __name__ == "__main__":
    raise SystemExit(main())
