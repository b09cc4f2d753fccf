"""`python -m engine bench`: ar, linear (DFlash chain) and ddtree side by side on held-out prompts.

    python -m engine bench --model DIR --draft DIR [--budgets 4,8,15,32,64] \\
        [--max-new-tokens 256] [--prompts 8] [--repeats 2] [--max-repeats 5] \\
        [--time-budget 600] [--concurrency 1,4] [--dtype float32] [--device cpu] [--tp 1]

Prompts are Python code from the standard-library files the demo model never trained on
(engine.data.corpus.held_out_prompts). Every method runs in this one process, under the rules of
`ddops bench` (issue 31; the statistics are engine/bench_stats.py, shared): prompt by prompt,
each repeat decodes the prompt with every method back to back, starting with the next method
each repeat, so a change in machine load hits them alike; each method first decodes one untimed
warm-up. A prompt gets at least --repeats repeats, more (up to --max-repeats) while its share of
--time-budget seconds lasts. A speedup is the ratio of a method's decode to ar's decode of the
same prompt in the same repeat; a repeat where one exceeds its tau (+ slack) was disturbed by
something else: it is redone and left out, as is a repeat whose decodes saw other processes'
load unevenly (engine.machine_state.uneven_load). Each decode runs in a quiet moment of the
machine and is run again when other processes took the cores during it (QuietGate).
Decoding is greedy, so the tokens never change.

Prints a table (tau = tokens committed per round, bonus included; decode tokens/s and speedup
over ar as medians with their intervals over the prompts' repeats; what a round costs), the
verdict (a winner only when its interval clears the others'), what the machine was doing (load,
other processes' CPU share, the GPU's clocks) and, as the last stdout line, one JSON document
with the same figures.

`--concurrency 1,4`: each level above 1 then measures the same way with that many copies of
each prompt decoded at once by the scheduler (engine/scheduler.py, one batched target pass a
step): the aggregate tok/s (every sequence's tokens over the wall time, prefill included) and
the speedup over ar at that level, with a verdict per level.

The round costs explain the speedups: `cost` is a round's time in ar steps, so speedup ~
tau / cost, and the draft and verify columns (ms per round) show where a round's time goes.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from types import SimpleNamespace

from engine.bench_stats import (
    RepeatSchedule,
    beyond_tau,
    median_interval,
    paired_ratios,
    rotated,
    spread_fields,
    spread_in,
    verdict,
)
from engine.machine_state import (
    MachineWatch,
    QuietGate,
    local_read,
    local_run,
    summary,
    uneven_load,
)
from engine.tools.arguments import positive_int, seconds

WARMUP_TOKENS = 16
ROUND_STAGES = ("draft", "tree", "verify", "commit")


@dataclass(frozen=True)
class Method:
    name: str  # "ar" | "linear" | "ddtree"
    budget: int | None = None

    @property
    def label(self) -> str:
        return f"{self.name} {self.budget}" if self.budget is not None else self.name


@dataclass
class Tally:
    """Sums over prompts for one method."""

    tokens: int = 0
    rounds: int = 0
    decode_seconds: float = 0.0
    stage_seconds: dict[str, float] = field(
        default_factory=lambda: dict.fromkeys(ROUND_STAGES, 0.0)
    )

    def add(
        self,
        acceptance_lengths: list[int],
        decode_tokens_per_s: float,
        stage_seconds: dict[str, float] | None = None,
    ) -> None:
        tokens = sum(acceptance_lengths)
        self.tokens += tokens
        self.rounds += len(acceptance_lengths)
        self.decode_seconds += tokens / decode_tokens_per_s if decode_tokens_per_s else 0.0
        for stage in ROUND_STAGES:
            self.stage_seconds[stage] += (stage_seconds or {}).get(stage, 0.0)

    @property
    def tau(self) -> float:
        return self.tokens / max(1, self.rounds)

    @property
    def round_ms(self) -> float:
        """Decode time per round (for ar: per token), everything between rounds included."""
        return 1000 * self.decode_seconds / max(1, self.rounds)

    def stage_ms(self, stage: str) -> float:
        return 1000 * self.stage_seconds[stage] / max(1, self.rounds)


def parse_budgets(text: str) -> list[int]:
    try:
        budgets = [int(b) for b in text.split(",") if b.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"budgets must be integers, got {text!r}") from None
    if not budgets or min(budgets) < 1:
        raise argparse.ArgumentTypeError(f"budgets must be positive integers, got {text!r}")
    return budgets


def parse_levels(text: str) -> list[int]:
    """An argparse type: concurrency levels like `1,4,8` (each >= 1), ascending."""
    try:
        levels = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"concurrency must be integers, got {text!r}") from None
    if not levels or levels[0] < 1:
        raise argparse.ArgumentTypeError(f"concurrency levels must be >= 1, got {text!r}")
    return levels


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, type=Path, help="target model directory (HF)")
    parser.add_argument("--draft", required=True, type=Path, help="DFlash drafter directory")
    parser.add_argument("--budgets", type=parse_budgets, default=[4, 8, 15, 32, 64])
    parser.add_argument("--max-new-tokens", type=positive_int, default=256)
    parser.add_argument("--prompts", type=positive_int, default=8, help="held-out prompts to run")
    parser.add_argument(
        "--repeats",
        type=positive_int,
        default=2,
        help="clean decodes of each prompt per method, at least (methods interleaved)",
    )
    parser.add_argument(
        "--max-repeats",
        type=positive_int,
        default=5,
        help="decodes of each prompt per method, at most, while the time budget lasts",
    )
    parser.add_argument(
        "--time-budget",
        type=seconds,
        default=600.0,
        help="seconds of decoding to spend on repeats beyond --repeats (0: exactly --repeats)",
    )
    parser.add_argument(
        "--concurrency",
        type=parse_levels,
        default=[1],
        help="levels above 1 also decode that many copies of each prompt at once through the "
        "scheduler: aggregate tok/s and speedups over ar at each level",
    )
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float64"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks for the target")
    parser.add_argument(
        "--no-cuda-graphs",
        dest="cuda_graphs",
        action="store_false",
        help="run every pass eagerly on CUDA (by default the static passes are replayed as CUDA graphs)",
    )


def methods_for(budgets: list[int]) -> list[Method]:
    return [Method("ar"), Method("linear")] + [Method("ddtree", b) for b in budgets]


# A pair: (prompt index, repeat) -> that decode's tokens/s, for one method.
Rates = dict[tuple[int, int], float]


def summarise(tallies: dict[Method, Tally], rates: dict[Method, Rates]) -> list[dict]:
    """One row per method: tau, decode tokens/s (median and interval over the prompts' clean
    repeats), speedup over ar (median and interval of the paired ratios), and the round's cost
    in ar steps with the ms per round of each stage."""
    ar_method = next(iter(tallies))
    ar = tallies[ar_method]
    rows = []
    for method, tally in tallies.items():
        speed = median_interval(rates[method].values())
        speedup = median_interval(paired_ratios(rates[method], rates[ar_method]))
        rows.append(
            {
                "method": method.name,
                "budget": method.budget,
                "tau": round(tally.tau, 3),
                **spread_fields("decode_tokens_per_s", speed, 2),
                **spread_fields("speedup", speedup, 3),
                "repeats": speed.n if speed else 0,
                "cost": _ratio(tally.round_ms, ar.round_ms),
                "round_ms": round(tally.round_ms, 3),
                "stage_ms": {stage: round(tally.stage_ms(stage), 3) for stage in ROUND_STAGES},
                "tokens": tally.tokens,
                "rounds": tally.rounds,
            }
        )
    return rows


def label_of(row: dict) -> str:
    return f"{row['method']} {row['budget']}" if row["budget"] is not None else row["method"]


def run_verdict(rows: list[dict]) -> dict:
    """The verdict over the rows' speedups (the first row is ar)."""
    return verdict({label_of(r): spread_in(r, "speedup", r["repeats"]) for r in rows}).to_json()


def _ratio(value: float, base: float) -> float | None:
    return round(value / base, 3) if base else None


def format_table(rows: list[dict]) -> str:
    header = ("method", "tau", "tok/s", "speedup", "cost", "draft ms", "verify ms")
    lines = [
        f"{header[0]:<12}{header[1]:>8}{header[2]:>10}{header[3]:>22}"
        + "".join(f"{h:>11}" for h in header[4:])
    ]
    for row in rows:
        spread = spread_in(row, "speedup", row["repeats"])
        speedup = spread.text("x") if spread else "-"
        cost = f"{row['cost']:.2f}" if row["cost"] is not None else "-"
        rate = row["decode_tokens_per_s"]
        stages = row["stage_ms"]
        lines.append(
            f"{label_of(row):<12}{row['tau']:>8.2f}{rate or 0:>10.1f}{speedup:>22}"
            f"{cost:>11}{stages['draft']:>11.2f}{stages['verify']:>11.2f}"
        )
    return "\n".join(lines)


def disturbed_in(results: dict[Method, object], ar: Method) -> list[str]:
    """The methods of one repeat whose speedup over the same repeat's ar exceeds their tau."""
    rates = {method: result.decode_tokens_per_s for method, result in results.items()}
    taus = {
        method: sum(lengths) / len(lengths) if (lengths := result.acceptance_lengths) else None
        for method, result in results.items()
    }
    return [method.label for method in beyond_tau(rates, taus, ar)]


class Interleaved:
    """The repeats of one measurement over the prompts, under issue 31's rules: prompt by
    prompt, each repeat runs every method back to back in rotated order, each in a quiet moment
    (the gate); a repeat with a speedup above tau, or whose decodes saw other processes' load
    unevenly, is redone and left out; `keep(method, (prompt, repeat), result)` gets the rest."""

    def __init__(self, args, methods: list[Method], gate: QuietGate, watch, readings) -> None:
        self.args, self.methods, self.gate = args, methods, gate
        self.watch, self.readings = watch, readings
        self.disturbed = self.uneven = self.turn = 0

    def measure(self, prompts: list[list[int]], decode, keep, what: str = "") -> None:
        args = self.args
        max_repeats = args.max_repeats if args.time_budget else args.repeats
        for index, prompt in enumerate(prompts):
            spent = self.readings[-1].at - self.readings[0].at
            share = max(0.0, args.time_budget - spent) / (len(prompts) - index)
            schedule = RepeatSchedule(args.repeats, max_repeats, share)
            while schedule.more():
                started = time.monotonic()
                order = rotated(self.methods, self.turn)
                self.turn += 1
                measured = {m: self.gate.measure(partial(decode, m, prompt)) for m in order}
                results = {method: result for method, (result, _) in measured.items()}
                suspects = disturbed_in(results, self.methods[0])
                shares = (load["others_cpu"] for _, load in measured.values())
                unpaired = not suspects and uneven_load(shares)
                self.disturbed += bool(suspects)
                self.uneven += unpaired
                schedule.record(time.monotonic() - started, disturbed=bool(suspects) or unpaired)
                if suspects or unpaired:
                    why = ", ".join(suspects) or "uneven load from other processes"
                    print(f"prompt {index + 1}: disturbed repeat ({why}), redone")
                    continue
                for method, result in results.items():
                    keep(method, (index, schedule.clean), result)
            self.readings.append(self.watch.reading())
            print(
                f"prompt {index + 1}/{len(prompts)} done ({len(prompt)} prompt tokens, "
                f"{schedule.clean} repeats{', ' + what if what else ''})",
                flush=True,
            )


def _scheduler(target, drafter, level: int, max_len: int):
    """A scheduler with `level` slots of `max_len` tokens (no prefix cache: every copy of a
    prompt is prefilled, as the one-at-a-time decodes are)."""
    from engine.cache_pool import CachePool
    from engine.scheduler import Scheduler

    pool = CachePool.for_server(target, drafter, max_len, 0)
    return Scheduler(target, drafter, pool.slots(level))


def decode_at_once(scheduler, cfg, prompt: list[int], n: int) -> SimpleNamespace:
    """`n` copies of `prompt` decoded at once by `scheduler`: the aggregate rate (every
    sequence's tokens over the wall time, prefill included) and every round's tokens."""
    import torch

    from engine.scheduler import Request

    done: list = []
    started = time.perf_counter()
    for _ in range(n):
        scheduler.add(Request(list(prompt), cfg, on_finish=done.append))
    with torch.inference_mode():
        while not scheduler.idle:
            scheduler.step()
    wall = time.perf_counter() - started
    failed = [f.error for f in done if f.error is not None]
    if failed:
        raise failed[0]
    tokens = sum(len(f.result.output_ids) for f in done)
    lengths = [length for f in done for length in f.result.acceptance_lengths]
    return SimpleNamespace(decode_tokens_per_s=tokens / wall, acceptance_lengths=lengths)


def concurrency_rows(level: int, rates: dict[Method, Rates]) -> list[dict]:
    """One row per method at `level` sequences at once: aggregate tok/s and the speedup over
    ar's same repeats, each a median with its interval."""
    ar = next(iter(rates))
    rows = []
    for method, found in rates.items():
        speed = median_interval(found.values())
        rows.append(
            {
                "method": method.name,
                "budget": method.budget,
                "concurrency": level,
                **spread_fields("tokens_per_s", speed, 2),
                **spread_fields("speedup", median_interval(paired_ratios(found, rates[ar])), 3),
                "repeats": speed.n if speed else 0,
            }
        )
    return rows


def format_concurrency(rows: list[dict]) -> str:
    lines = [f"{'method':<12}{'tok/s':>10}{'speedup':>22}"]
    for row in rows:
        spread = spread_in(row, "speedup", row["repeats"])
        rate = spread_in(row, "tokens_per_s", row["repeats"])
        lines.append(
            f"{label_of(row):<12}{rate.median if rate else 0:>10.1f}"
            f"{spread.text('x') if spread else '-':>22}"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    import torch

    from engine.data.corpus import held_out_prompts
    from engine.decode import GenerationConfig, generate
    from engine.models import load_drafter
    from engine.models.common import DTYPES
    from engine.parallel import close_target, open_target
    from engine.tokenizer import load_tokenizer

    dtype = DTYPES[args.dtype]
    target = open_target(args.model, dtype, args.device, args.tp)
    if target is None:  # a torchrun follower: rank 0 has finished
        return 0
    drafter = load_drafter(args.draft, dtype=dtype, device=args.device)
    tokenizer = load_tokenizer(args.model)
    prompts = [tokenizer.encode(text) for text in held_out_prompts(args.prompts)]
    methods = methods_for(args.budgets)

    def config_for(method: Method, max_new_tokens: int = args.max_new_tokens):
        return GenerationConfig(
            method=method.name,
            budget=method.budget or 15,
            max_new_tokens=max_new_tokens,
            cuda_graphs=args.cuda_graphs,
        )

    def decode(method: Method, prompt: list[int], max_new_tokens: int):
        with torch.inference_mode():
            return generate(target, drafter, prompt, config_for(method, max_new_tokens))

    for method in methods:
        decode(method, prompts[0], WARMUP_TOKENS)
    watch = MachineWatch(local_read, local_run if args.device != "cpu" else None, time.process_time)
    readings = [watch.reading()]
    gate = QuietGate(watch)  # each decode in a quiet moment, sent again when disturbed
    tallies = {method: Tally() for method in methods}
    rates: dict[Method, Rates] = {method: {} for method in methods}

    def keep(method: Method, key: tuple[int, int], result) -> None:
        rates[method][key] = result.decode_tokens_per_s
        tallies[method].add(
            result.acceptance_lengths, result.decode_tokens_per_s, result.stage_seconds
        )

    repeats = Interleaved(args, methods, gate, watch, readings)
    repeats.measure(prompts, lambda m, p: decode(m, p, args.max_new_tokens), keep)
    served = []
    for level in (n for n in args.concurrency if n > 1):
        longest = max(len(p) for p in prompts) + args.max_new_tokens
        scheduler = _scheduler(target, drafter, level, longest)
        level_rates: dict[Method, Rates] = {method: {} for method in methods}

        def keep_level(method: Method, key: tuple[int, int], result, into=level_rates) -> None:
            into[method][key] = result.decode_tokens_per_s

        def at_once(method: Method, prompt: list[int], n=level, scheduler=scheduler):
            return decode_at_once(scheduler, config_for(method), prompt, n)

        repeats.measure(prompts, at_once, keep_level, f"{level} at once")
        served += concurrency_rows(level, level_rates)
    close_target(target)
    rows = summarise(tallies, rates)
    machine = summary(readings, repeats.disturbed, gate.busy_requests, repeats.uneven)
    decision = run_verdict(rows)
    print(format_table(rows))
    print(decision["text"])
    for level in sorted({row["concurrency"] for row in served}):
        at_level = [row for row in served if row["concurrency"] == level]
        print(f"\n{level} sequences at once (aggregate tok/s, prefill included):")
        print(format_concurrency(at_level))
        print(run_verdict(at_level)["text"])
    if machine["warning"]:
        print(f"warning: {machine['warning']}")
    print(
        json.dumps(
            {
                "model": str(args.model),
                "draft": str(args.draft),
                "prompts": len(prompts),
                "repeats": args.repeats,
                "max_repeats": args.max_repeats,
                "time_budget_s": args.time_budget,
                "max_new_tokens": args.max_new_tokens,
                "dtype": args.dtype,
                "device": args.device,
                "tp": args.tp,
                "cuda_graphs": args.cuda_graphs,
                "concurrency_levels": args.concurrency,
                "threads": torch.get_num_threads(),
                "results": rows,
                "verdict": decision,
                "concurrency": served,
                "machine": machine,
            }
        )
    )
    return 0
