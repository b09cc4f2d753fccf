"""The bench: the ar / DFlash-chain / DDTree matrix against an engine's OpenAI API.

    from ops.bench import BenchConfig, EngineClient, RunStore, run_bench, RichProgress
    with EngineClient("http://127.0.0.1:8000") as client:
        store = RunStore.open(results_dir, {"bench": config.to_json()}, versions={})
        result = run_bench(config, client, store, RichProgress())
    render_report(result.run_dir)

Modules: matrix (what to measure), prompts (scenario prompts sized with /tokenize), client
(streamed, timed requests), runner (run_bench), report (markdown, CSV, JSON, PNG), endpoint
(preflight: the recover chain, or a plain URL), tunnel (SSH port forward to a remote CT's
engine). The result store (run directories, crash-safe) is ops/results.py, below the chain that
quarantines its stale runs. `ddops bench` is ops/commands/bench.py.
"""

from ops.bench.client import EngineClient
from ops.bench.matrix import AgenticShape, BenchConfig, Cell, Method, parse_methods
from ops.bench.report import render_report
from ops.bench.runner import NullProgress, RichProgress, RunResult, run_bench
from ops.results import RunStore, find_stale_runs, quarantine_run

__all__ = [
    "AgenticShape",
    "BenchConfig",
    "Cell",
    "EngineClient",
    "Method",
    "NullProgress",
    "RichProgress",
    "RunResult",
    "RunStore",
    "find_stale_runs",
    "parse_methods",
    "quarantine_run",
    "render_report",
    "run_bench",
]
