"""Run the bench matrix against one engine: `run_bench(config, client, store, progress)`.

    with EngineClient(url) as client:
        store = RunStore.open(results_dir, run_config_json, versions)
        result = run_bench(BenchConfig(lengths=(16, 32)), client, store, RichProgress())

Cells already in the store are skipped (a resumed run measures only the missing ones). Each cell
first sends `config.warmup` short requests with its method (not counted), then `repeats`
measured ones; every measured request is appended to the cell's partial file as it finishes,
and the cell's summary is written atomically at the end. A failure or Ctrl-C marks the run
crashed (partial files moved aside) before it propagates; kill -9 leaves a stale run that the
next RunStore.open quarantines.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Protocol

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ops.bench.client import EngineClient, Sample
from ops.bench.matrix import BenchConfig, Cell
from ops.bench.prompts import AgenticTranscript, decode_prompt, long_prompt
from ops.results import RunStore

WARMUP_TOKENS = 8


class BenchProgress(Protocol):
    """What run_bench tells about its progress (RichProgress draws bars on stderr)."""

    def start(self, total: int, done: int) -> None: ...
    def cell_started(self, cell: Cell) -> None: ...
    def cell_finished(self, cell: Cell, data: dict) -> None: ...
    def stop(self) -> None: ...


class NullProgress:
    def start(self, total: int, done: int) -> None:
        pass

    def cell_started(self, cell: Cell) -> None:
        pass

    def cell_finished(self, cell: Cell, data: dict) -> None:
        pass

    def stop(self) -> None:
        pass


class RichProgress:
    """One progress bar over the matrix's cells, on stderr."""

    def __init__(self, console: Console | None = None) -> None:
        self._bar = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console or Console(stderr=True),
        )
        self._task = None

    def start(self, total: int, done: int) -> None:
        self._bar.start()
        self._task = self._bar.add_task("bench", total=total, completed=done)

    def cell_started(self, cell: Cell) -> None:
        self._bar.update(self._task, description=f"{cell.column} {cell.method.label}")

    def cell_finished(self, cell: Cell, data: dict) -> None:
        self._bar.advance(self._task)

    def stop(self) -> None:
        self._bar.stop()


@dataclass(frozen=True)
class RunResult:
    run_dir: Path
    cells: list[dict]  # every finished cell of the run, as stored
    resumed: bool  # this run continued an earlier, crashed one


def run_bench(
    config: BenchConfig, client: EngineClient, store: RunStore, progress: BenchProgress
) -> RunResult:
    """Measure every cell of `config` missing from `store`, then mark the run complete."""
    cells = config.cells()
    progress.start(len(cells), sum(store.has_cell(c.key) for c in cells))
    try:
        for cell in cells:
            if store.has_cell(cell.key):
                continue
            progress.cell_started(cell)
            data = measure_cell(config, client, cell, partial(store.record_sample, cell.key))
            store.write_cell(cell.key, data)
            progress.cell_finished(cell, data)
    except BaseException as exc:
        store.fail(f"{type(exc).__name__}: {exc}")
        raise
    finally:
        progress.stop()
    store.finish()
    return RunResult(store.run_dir, store.cells(), store.resumed)


# -- one cell ------------------------------------------------------------------------------------
Record = Callable[[dict], None]


def measure_cell(config: BenchConfig, client: EngineClient, cell: Cell, record: Record) -> dict:
    """Warm up, measure the cell's requests (recording each), and summarise them."""
    for _ in range(config.warmup):
        _request(config, client, cell, decode_prompt(), min(cell.length, WARMUP_TOKENS))
    measure = {"decode": _measure_decode, "long": _measure_long, "agentic": _measure_agentic}
    samples, notes = measure[cell.scenario](config, client, cell, record)
    data = {"cell": cell_json(cell), "skipped": notes.pop("skipped", None), **notes}
    data["metrics"] = summarize([s for s, _ in samples]) if samples else None
    data["samples"] = [{**where, **s.to_json()} for s, where in samples]
    return data


def cell_json(cell: Cell) -> dict:
    return {
        "key": cell.key,
        "scenario": cell.scenario,
        "length": cell.length,
        "method": cell.method.label,
    }


Measured = tuple[list[tuple[Sample, dict]], dict]


def _request(config: BenchConfig, client: EngineClient, cell: Cell, prompt: str, tokens: int):
    return client.complete(
        prompt,
        max_tokens=tokens,
        method=cell.method,
        temperature=config.temperature,
        seed=config.seed,
    )


def _take(samples: list, record: Record, sample: Sample, **where) -> None:
    samples.append((sample, where))
    record({**where, **sample.to_json()})


def _too_long(prompt_tokens: int, max_tokens: int, limit: int, what: str = "the prompt") -> str:
    return (
        f"{what} has {prompt_tokens} tokens; with max_tokens {max_tokens} that is "
        f"{prompt_tokens + max_tokens} > max-model-len {limit}"
    )


def _repeated(
    config: BenchConfig, client: EngineClient, cell: Cell, prompt: str, record: Record
) -> list:
    samples: list = []
    for repeat in range(config.repeats):
        done = _request(config, client, cell, prompt, cell.length)
        _take(samples, record, done.sample, repeat=repeat)
    return samples


def _measure_decode(
    config: BenchConfig, client: EngineClient, cell: Cell, record: Record
) -> Measured:
    limit, tokens = client.max_model_len(), client.count_tokens(decode_prompt())
    if tokens + cell.length > limit:
        return [], {"skipped": _too_long(tokens, cell.length, limit)}
    return _repeated(config, client, cell, decode_prompt(), record), {}


def _measure_long(
    config: BenchConfig, client: EngineClient, cell: Cell, record: Record
) -> Measured:
    limit = client.max_model_len()
    fitted = long_prompt(client.count_tokens, max_model_len=limit, max_tokens=cell.length)
    prompt = {"tokens": fitted.tokens, "max_tokens": cell.length, "max_model_len": limit}
    if fitted.skipped:
        return [], {"skipped": fitted.skipped, "prompt": prompt}
    return _repeated(config, client, cell, fitted.prompt, record), {"prompt": prompt}


def _measure_agentic(
    config: BenchConfig, client: EngineClient, cell: Cell, record: Record
) -> Measured:
    limit = client.max_model_len()
    samples: list = []
    contexts = []
    for repeat in range(config.repeats):
        transcript = AgenticTranscript(client.count_tokens, config.agentic, cell.length, limit)
        if transcript.skipped:
            return [], {"skipped": transcript.skipped}
        answer = ""
        for turn in range(config.agentic.turns):
            fitted = transcript.prompt_for_turn(turn, answer)
            if fitted.tokens + cell.length > limit:
                why = _too_long(fitted.tokens, cell.length, limit, f"turn {turn}'s transcript")
                return [], {"skipped": why}
            done = _request(config, client, cell, fitted.prompt, cell.length)
            answer = done.text
            _take(samples, record, done.sample, repeat=repeat, turn=turn)
        contexts.append(fitted.tokens + done.sample.completion_tokens)
    shape = {"turns": config.agentic.turns, "context": config.agentic.context}
    return samples, {"agentic": {**shape, "final_context_tokens": max(contexts)}}


# -- summaries -----------------------------------------------------------------------------------
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
    """A cell's figures over its measured requests (token-weighted rates)."""
    decoding = [s for s in samples if s.decode_tok_s is not None]
    tokens = sum(s.completion_tokens for s in samples)
    rounds = sum(s.rounds for s in samples)
    tpots = [s.tpot_s for s in decoding]
    decode_s = sum(s.decode_s for s in decoding)
    return {
        "requests": len(samples),
        "completion_tokens": tokens,
        "decode_tok_s": sum(s.completion_tokens - 1 for s in decoding) / decode_s
        if decode_s
        else None,
        "e2e_tok_s": tokens / sum(s.e2e_s for s in samples),
        "ttft_s": statistics.median(s.ttft_s for s in samples),
        "tpot_p50_s": percentile(tpots, 50),
        "tpot_p90_s": percentile(tpots, 90),
        "tau": sum(s.tau * s.rounds for s in samples) / rounds if rounds else None,
        "rounds": rounds / len(samples),
    }
