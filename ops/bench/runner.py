"""Run the bench matrix against engines: `run_bench(config, clients, store, progress, watch)`.

    with EngineClient(url) as client:
        store = RunStore.open(results_dir, run_config_json, versions)
        result = run_bench(BenchConfig(lengths=(16, 32)), client, store, RichProgress())

The matrix is measured a group (a scenario at an output length) at a time, interleaved: each
method first sends `config.warmup` short requests (not counted); then each repeat runs every
method once, back to back, starting with the next method each repeat (engine.bench_stats), so
load that comes or goes lands on all of them alike. After a repeat, a method whose speedup over
ar's same repeat exceeds its tau marks the repeat disturbed: its samples are kept, marked, and
another repeat runs instead (figures.disturbed_methods); so does a repeat whose requests saw
other processes' load unevenly (engine.machine_state.uneven_load: a burst on one method's
request and not the next one's). How many repeats: at least
`config.repeats` clean ones, then more while the group's share of `config.time_budget_s` lasts
(engine.bench_stats.RepeatSchedule). The machine is read before and after each group
(engine.machine_state), and each request is measured in a quiet moment (QuietGate): a request
during which other processes took the cores is sent again once they let go (a cache-on agentic
turn excepted: sent again it would find itself cached). Each sample carries the share of CPU
other processes took during it, and the manifest gets the run's machine summary with a warning
when it was busy.

At a concurrency above 1 (or with a request rate) a method's turn in a repeat is a window of
requests sent at once (ops/bench/load.py): the gate measures the window as a whole, each of its
requests a sample (with `request`, its place in the window, and `client_cpu`, the bench's own
CPU over the window), and the tau check compares the windows' aggregate output tok/s.

Servers side by side (`config.servers`, one client each, `clients[cell.server]`): every
method runs on every server, all interleaved in the same repeats; each server's methods are
held to its own ar for the tau check. Prompts are sized with the first server's /tokenize.

The agentic scenario runs one session per method and repeat (its own conversation, so no session
reuses another's prefix cache); each turn is sent with the prefix cache on (decoded to the
length: these count for speed) and re-sent with it off (`cache_prompt: false`, one token: its
time to first token). The decode and long scenarios send their prompts with the cache off, so
every request prefills its whole prompt as before.

Every measured request is appended to its cell's partial file as it finishes; a group's cells
(samples marked with their repeat's verdict) are written atomically at its end. Groups already
stored are skipped (a resumed run measures the rest). A failure or Ctrl-C marks the run crashed
(partial files moved aside) before it propagates; kill -9 leaves a stale run that the next
RunStore.open quarantines.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from engine.bench_stats import RepeatSchedule, rotated
from engine.machine_state import MachineWatch, QuietGate, summary, uneven_load
from ops.bench.client import CompletionRequest, EngineClient, Sample
from ops.bench.figures import (
    CACHE_OFF,
    RepeatFigure,
    disturbed_methods,
    repeat_figures,
    summarize,
)
from ops.bench.load import Sleep, Window
from ops.bench.matrix import BenchConfig, Cell, Group, Method
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
        self._bar.update(self._task, description=f"{cell.column} (interleaved)")

    def cell_finished(self, cell: Cell, data: dict) -> None:
        self._bar.advance(self._task)

    def stop(self) -> None:
        self._bar.stop()


@dataclass(frozen=True)
class RunResult:
    run_dir: Path
    cells: list[dict]  # every finished cell of the run, as stored
    resumed: bool  # this run continued an earlier, crashed one
    machine: dict = field(default_factory=dict)  # engine.machine_state.summary of this attempt


def run_bench(
    config: BenchConfig,
    clients: EngineClient | Sequence[EngineClient],
    store: RunStore,
    progress: BenchProgress,
    watch: MachineWatch | None = None,
) -> RunResult:
    """Measure every group of `config` missing from `store`, then mark the run complete;
    `clients`: one per server (config.servers), or the one."""
    clients = [clients] if isinstance(clients, EngineClient) else list(clients)
    if len(clients) != config.servers:
        raise ValueError(f"{config.servers} servers configured, {len(clients)} clients given")
    watch = watch or MachineWatch()
    pending = [g for g in config.groups() if not all(store.has_cell(c.key) for c in g.cells)]
    done = len(config.cells()) - sum(len(g.cells) for g in pending)  # a group is redone whole
    progress.start(len(config.cells()), done)
    readings = [watch.reading()]
    gate = QuietGate(watch)
    disturbed = uneven = 0
    try:
        for index, group in enumerate(pending):
            spent = readings[-1].at - readings[0].at
            share = max(0.0, config.time_budget_s - spent) / (len(pending) - index)
            progress.cell_started(group.cells[0])
            cells = measure_group(config, clients, group, store.record_sample, gate, share)
            readings.append(watch.reading())
            for cell in group.cells:
                store.write_cell(cell.key, cells[cell.key])
                progress.cell_finished(cell, cells[cell.key])
            disturbed += cells[group.cells[0].key].get("disturbed_repeats", 0)
            uneven += cells[group.cells[0].key].get("uneven_repeats", 0)
    except BaseException as exc:
        store.fail(f"{type(exc).__name__}: {exc}")
        raise
    finally:
        progress.stop()
    machine = summary(readings, disturbed, gate.busy_requests, uneven)
    store.finish(machine=machine)
    return RunResult(store.run_dir, store.cells(), store.resumed, machine)


# -- one group -------------------------------------------------------------------------------------
Record = Callable[[str, dict], None]  # (cell key, sample) -> kept in the cell's partial file
Taken = dict[Cell, list[dict]]  # a repeat's stored samples per cell (with where)
Measured = Iterator[tuple[Cell, Sample, dict]]  # each request of a repeat as it finishes


class Skipped(Exception):
    """The group cannot be measured at this length (the numbers say why)."""


def measure_group(
    config: BenchConfig,
    clients: Sequence[EngineClient],
    group: Group,
    record: Record,
    gate: QuietGate,
    share_s: float,
) -> dict[str, dict]:
    """Warm up each method on each server, then measure the group in interleaved repeats, each
    request in a quiet moment of the machine (`gate`); each cell's data."""
    cells = list(group.cells)
    samples: dict[Cell, list[dict]] = {cell: [] for cell in cells}
    max_repeats = config.max_repeats if config.time_budget_s else config.repeats
    schedule = RepeatSchedule(config.repeats, max_repeats, share_s)
    beyond_tau = uneven = 0
    try:
        scenario = SCENARIO_RUNS[group.scenario](config, clients, gate, group)
        for cell in cells:
            for _ in range(config.warmup):
                tokens = min(group.length, WARMUP_TOKENS)
                _request(config, clients[cell.server], cell.method, decode_prompt(), tokens)
        while schedule.more():
            repeat, started = schedule.attempts, gate.watch.clock()
            taken: Taken = {cell: [] for cell in cells}
            for cell, sample, where in scenario.run_repeat(repeat, rotated(cells, repeat)):
                entry = {"repeat": repeat, **where, **sample.to_json()}  # others_cpu: the gate's
                record(cell.key, entry)
                taken[cell].append(entry)
            over = _disturbed(taken, repeat, group.concurrency)
            unpaired = not over and uneven_load(_shares(taken))
            beyond_tau, uneven = beyond_tau + over, uneven + unpaired
            disturbed = over or unpaired
            for cell, entries in taken.items():  # kept, marked with the repeat's verdict
                samples[cell] += [{**entry, "disturbed": disturbed} for entry in entries]
            schedule.record(gate.watch.clock() - started, disturbed=disturbed)
    except Skipped as why:
        return {cell.key: _cell_data(cell, [], {"skipped": str(why)}) for cell in group.cells}
    notes = {**scenario.notes(), "disturbed_repeats": beyond_tau}
    if uneven:
        notes["uneven_repeats"] = uneven
    if config.slo is not None:
        notes["slo"] = asdict(config.slo)
    return {cell.key: _cell_data(cell, samples[cell], notes) for cell in group.cells}


def _shares(taken: Taken) -> list[float | None]:
    """Other processes' CPU share during each measurement of a repeat (a window's once); the
    agentic scenario's cache-off re-sends aside (they time the first token only)."""
    return [
        entry.get("others_cpu")
        for entries in taken.values()
        for entry in entries
        if entry.get("cache") != CACHE_OFF and not entry.get("request")
    ]


def _disturbed(taken: Taken, repeat: int, concurrency: int) -> bool:
    """Whether a method's speedup over its server's ar in this repeat exceeds its tau."""
    by_server: dict[int, dict[str, RepeatFigure]] = {}
    for cell, entries in taken.items():
        if entries:
            figure = repeat_figures(entries, concurrency)[repeat]
            by_server.setdefault(cell.server, {})[cell.method.label] = figure
    return any(disturbed_methods(figures) for figures in by_server.values())


def cell_json(cell: Cell) -> dict:
    return {
        "key": cell.key,
        "scenario": cell.scenario,
        "length": cell.length,
        "method": cell.method.label,
        "concurrency": cell.concurrency,
        "server": cell.server,
    }


def _cell_data(cell: Cell, samples: list[dict], notes: dict) -> dict:
    counted = [
        Sample.from_json(s) for s in samples if not s["disturbed"] and s.get("cache") != CACHE_OFF
    ]
    return {
        "cell": cell_json(cell),
        "skipped": notes.get("skipped"),
        **{k: v for k, v in notes.items() if k != "skipped"},
        "metrics": summarize(counted) if counted else None,
        "samples": samples,
    }


def _request(
    config: BenchConfig,
    client: EngineClient,
    method: Method,
    prompt: str,
    tokens: int,
    cache_prompt: bool = False,
):
    return client.complete(
        prompt,
        max_tokens=tokens,
        method=method,
        temperature=config.temperature,
        seed=config.seed,
        cache_prompt=cache_prompt,
    )


def _quiet_request(gate: QuietGate, *request, retry: bool = True) -> tuple[Any, dict]:
    """`_request(*request)` in a quiet moment: its response and the machine during it."""
    return gate.measure(lambda: _request(*request), retry=retry)


def _too_long(prompt_tokens: int, max_tokens: int, limit: int, what: str = "the prompt") -> str:
    return (
        f"{what} has {prompt_tokens} tokens; with max_tokens {max_tokens} that is "
        f"{prompt_tokens + max_tokens} > max-model-len {limit}"
    )


# -- the scenarios: one repeat each ------------------------------------------------------------
def window_sleep(watch: MachineWatch) -> Sleep:
    """How a window waits for its next arrival: on the watch's clock (a scripted one in
    tests advances), else asyncio's."""
    if watch.sleep is time.sleep:
        return asyncio.sleep

    async def scripted(seconds: float) -> None:
        watch.sleep(seconds)
        await asyncio.sleep(0)

    return scripted


class _OnePrompt:
    """decode and long: every method decodes the same prompt once a repeat, cache off; at a
    concurrency above 1 (or a request rate), a window of requests of it."""

    def __init__(
        self,
        config: BenchConfig,
        clients: Sequence[EngineClient],
        gate: QuietGate,
        length: int,
        prompt: str,
    ) -> None:
        self.config, self.clients, self.gate = config, clients, gate
        self.length, self.prompt = length, prompt
        self.concurrency = 1
        self.extra: dict = {}

    def run_repeat(self, repeat: int, order: Sequence[Cell]) -> Measured:
        config = self.config
        count = self.concurrency * config.requests_per_client
        if count == 1 and config.request_rate is None:  # one request: as before issue 37
            for cell in order:
                request = (config, self.clients[cell.server], cell.method, self.prompt, self.length)
                response, machine = _quiet_request(self.gate, *request)
                yield cell, response.sample, machine
            return
        for cell in order:
            client = self.clients[cell.server]
            request = CompletionRequest(
                self.prompt, self.length, cell.method, config.temperature, config.seed, False
            )
            window = Window(
                [request] * count,
                self.concurrency,
                config.request_rate,
                seed=config.seed + repeat,
                sleep=window_sleep(self.gate.watch),
            )
            sent, machine = self.gate.measure(lambda w=window, c=client: w.run(c))
            for index, done in enumerate(sent.completions):
                where = {**machine, "request": index, "client_cpu": _rounded(sent.client_cpu)}
                yield cell, done.sample, where

    def notes(self) -> dict:
        return self.extra


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def _max_model_len(clients: Sequence[EngineClient]) -> int:
    """The shortest context of the servers: what every one of them takes."""
    return min(client.max_model_len() for client in clients)


def _decode_run(
    config: BenchConfig, clients: Sequence[EngineClient], gate: QuietGate, group: Group
) -> _OnePrompt:
    limit, tokens = _max_model_len(clients), clients[0].count_tokens(decode_prompt())
    if tokens + group.length > limit:
        raise Skipped(_too_long(tokens, group.length, limit))
    run = _OnePrompt(config, clients, gate, group.length, decode_prompt())
    run.concurrency = group.concurrency
    return run


def _long_run(
    config: BenchConfig, clients: Sequence[EngineClient], gate: QuietGate, group: Group
) -> _OnePrompt:
    limit, length = _max_model_len(clients), group.length
    fitted = long_prompt(clients[0].count_tokens, max_model_len=limit, max_tokens=length)
    if fitted.skipped:
        raise Skipped(fitted.skipped)
    run = _OnePrompt(config, clients, gate, length, fitted.prompt)
    run.concurrency = group.concurrency
    run.extra = {"prompt": {"tokens": fitted.tokens, "max_tokens": length, "max_model_len": limit}}
    return run


class _AgenticRun:
    """One session per method and repeat, or at concurrency N, N agents at once, each its own
    session; each turn with the prefix cache on, then re-sent with it off for its time to first
    token (at N: a window of the N agents' turns, then a window of the re-sends). Turns
    interleave the methods (rotated each repeat). A cache-on turn is sent once (sent again it
    would find itself cached), in a quiet moment."""

    def __init__(
        self, config: BenchConfig, clients: Sequence[EngineClient], gate: QuietGate, group: Group
    ) -> None:
        self.config, self.clients, self.gate, self.length = config, clients, gate, group.length
        self.agents = group.concurrency
        self.limit = _max_model_len(clients)
        self.final_context = 0
        probe = self._transcript("probe")
        if probe.skipped:
            raise Skipped(probe.skipped)

    def _transcript(self, session: str) -> AgenticTranscript:
        shape = self.config.agentic
        return AgenticTranscript(
            self.clients[0].count_tokens, shape, self.length, self.limit, session=session
        )

    def run_repeat(self, repeat: int, order: Sequence[Cell]) -> Measured:
        agents = range(self.agents)
        sessions = {
            cell: [self._transcript(_session(repeat, cell, agent)) for agent in agents]
            for cell in order
        }
        answers = {cell: [""] * self.agents for cell in order}
        for turn in range(self.config.agentic.turns):
            for cell in order:
                prompts = [
                    sessions[cell][agent].prompt_for_turn(turn, answers[cell][agent])
                    for agent in agents
                ]
                longest = max(fitted.tokens for fitted in prompts)
                if longest + self.length > self.limit:
                    what = f"turn {turn}'s transcript"
                    raise Skipped(_too_long(longest, self.length, self.limit, what))
                on, on_machine = self._window(cell, prompts, self.length, True)
                off, off_machine = self._window(cell, prompts, 1, False)
                for agent, (done_on, done_off) in enumerate(zip(on, off, strict=True)):
                    answers[cell][agent] = done_on.text
                    where = {"turn": turn} | ({"request": agent} if self.agents > 1 else {})
                    yield cell, done_on.sample, {**where, **on_machine}
                    yield cell, done_off.sample, {**where, "cache": CACHE_OFF, **off_machine}
                    context = prompts[agent].tokens + done_on.sample.completion_tokens
                    self.final_context = max(self.final_context, context)

    def _window(self, cell: Cell, prompts, tokens: int, cache: bool) -> tuple[list, dict]:
        """The agents' prompts sent at once (one: a plain request), in a quiet moment; a
        cache-on turn is sent once."""
        config, client = self.config, self.clients[cell.server]
        if self.agents == 1:
            request = (config, client, cell.method, prompts[0].prompt, tokens, cache)
            done, machine = _quiet_request(self.gate, *request, retry=not cache)
            return [done], machine
        requests = [
            CompletionRequest(p.prompt, tokens, cell.method, config.temperature, config.seed, cache)
            for p in prompts
        ]
        window = Window(requests, self.agents, sleep=window_sleep(self.gate.watch))
        sent, machine = self.gate.measure(lambda: window.run(client), retry=not cache)
        return sent.completions, {**machine, "client_cpu": _rounded(sent.client_cpu)}

    def notes(self) -> dict:
        shape = {"turns": self.config.agentic.turns, "context": self.config.agentic.context}
        return {"agentic": {**shape, "final_context_tokens": self.final_context}}


def _session(repeat: int, cell: Cell, agent: int = 0) -> str:
    """An agentic session's name: its own conversation per repeat, method, server and agent."""
    server = f"-s{cell.server + 1}" if cell.server else ""
    return f"{repeat}-{cell.method.label}{server}" + (f"-a{agent + 1}" if agent else "")


SCENARIO_RUNS = {"decode": _decode_run, "long": _long_run, "agentic": _AgenticRun}
