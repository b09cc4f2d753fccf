"""The busy-machine check of issue 31: the demo's bench on the demo pair, once as the machine is
and once while burst_load.py takes the cores in bursts; then the two ddtree:15 / ar speedups
side by side (within 35% of each other?) and every reported speedup against its tau. A dev tool
(not shipped): the closing note's figures come from it.

    python -m tests.helpers.bench_under_bursts --out /tmp/i31/check            # both runs
    python -m tests.helpers.bench_under_bursts --out DIR --runs quiet          # one of them

It serves the demo pair with `python -m engine serve` (--threads torch threads: 2, as the demo's
2-core CT gives it), runs `ddops bench --url` with the demo's bench options (ops/demo_story.py:
methods, length, repeats, time budget) and prints each run's table, verdict and machine warning,
then the comparison. The burst load: --burst-workers processes, --burst-on / --burst-off seconds.
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


def bench_argv(url: str, out: Path) -> list[str]:
    return [
        *(sys.executable, "-m", "ops.cli", "--json", "bench", "--url", url, "--out", str(out)),
        *("--methods", BENCH_METHODS, "--lengths", BENCH_LENGTHS, "--repeats", BENCH_REPEATS),
        *("--time-budget", BENCH_BUDGET_S),
    ]


def run_bench(url: str, out: Path, bursts: argparse.Namespace | None) -> dict:
    load = None
    if bursts is not None:
        load = subprocess.Popen(
            [sys.executable, "-m", "tests.helpers.burst_load", "--workers", str(bursts.burst_workers),
             "--on", str(bursts.burst_on), "--off", str(bursts.burst_off), "--seconds", "3600"]
        )  # fmt: skip
    try:
        done = subprocess.run(bench_argv(url, out), capture_output=True, text=True, check=True)
    finally:
        if load is not None:
            load.terminate()
            load.wait()
    return json.loads(done.stdout)


def speedups(document: dict) -> dict[str, dict]:
    cells = RunStore.load(Path(document["run_dir"])).cells()
    return {row["method"]: row for row in rows_from_cells(cells)}


def show(name: str, document: dict) -> None:
    rows = speedups(document)
    print(f"\n== {name}: {document['run_dir']}")
    print(f"  {'method':<10} {'tau':>5} {'tok/s':>8}  speedup (95% interval)  repeats (disturbed)")
    for method, row in rows.items():
        interval = f"{row['speedup']:.2f}x ({row['speedup_low']:.2f}-{row['speedup_high']:.2f})"
        print(
            f"  {method:<10} {row['tau']:>5.2f} {row['decode_tok_s']:>8.1f}  {interval:<22} "
            f"{row['repeats']} ({row['disturbed']})"
        )
    for found in document["verdicts"]:
        print(f"  verdict: {found['text']}")
    machine = document["machine"]
    print(f"  machine: others' CPU {machine.get('others_cpu')}, load {machine.get('load_end')}")
    print(f"  warning: {machine.get('warning')}")


def compare(quiet: dict, busy: dict) -> None:
    a, b = speedups(quiet)["ddtree:15"]["speedup"], speedups(busy)["ddtree:15"]["speedup"]
    apart = abs(a - b) / min(a, b)
    verdict = "within" if apart <= TOLERANCE else "NOT within"
    print(
        f"\nddtree:15 / ar: {a:.2f}x quiet, {b:.2f}x under bursts: {apart:.0%} apart ({verdict} 35%)"
    )
    for name, document in (("quiet", quiet), ("bursts", busy)):
        above = [
            f"{m} {r['speedup']:.2f}x > tau {r['tau']:.2f}"
            for m, r in speedups(document).items()
            if r["speedup"] > r["tau"] * SLACK
        ]
        print(f"{name}: speedups above tau (+10%): {', '.join(above) or 'none'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--runs", choices=("both", "quiet", "bursts"), default="both")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--burst-workers", type=int, default=2)
    parser.add_argument("--burst-on", type=float, default=1.5)
    parser.add_argument("--burst-off", type=float, default=1.5)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    server = start_engine_server(
        DEMO_TARGET,
        DEMO_TARGET.parent / "draft",
        extra_args=["--max-model-len", "2048", "--budget", "15"],
        log_path=args.out / "serve.log",
        cpu_threads=args.threads,
    )
    documents = {}
    try:
        for name in ("quiet", "bursts") if args.runs == "both" else (args.runs,):
            bursts = args if name == "bursts" else None
            documents[name] = run_bench(server.url, args.out / name, bursts)
            (args.out / f"{name}.json").write_text(json.dumps(documents[name], indent=1))
            show(name, documents[name])
    finally:
        server.stop()
    if len(documents) == 2:
        compare(documents["quiet"], documents["bursts"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
