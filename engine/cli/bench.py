"""`python -m engine bench`: ar, linear (DFlash chain) and ddtree side by side on held-out prompts.

    python -m engine bench --model DIR --draft DIR [--budgets 4,8,15,32,64] \\
        [--max-new-tokens 256] [--prompts 8] [--repeats 1] [--dtype float32] [--device cpu] \\
        [--tp 1]

Prompts are Python code from the standard-library files the demo model never trained on
(engine.data.corpus.held_out_prompts). Every method runs in this one process, prompt by prompt
(all methods on prompt 1, then on prompt 2, ...) so a change in machine load hits them alike;
each method first decodes one untimed warm-up. With --repeats N each method decodes each prompt
N times (methods still interleaved) and the decode of median speed counts: that damps a noisy
machine without favouring any method (decoding is greedy, so the tokens never change). Prints
a table (tau = tokens committed per round, bonus included; decode tokens/s; speedup over ar;
what a round costs) and, as the last stdout line, one JSON document with the same figures.

The round costs explain the speedups: `cost` is a round's time in ar steps, so speedup =
tau / cost, and the draft and verify columns (ms per round) show where a round's time goes.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.decode import GenerationResult

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
    def tokens_per_s(self) -> float:
        return self.tokens / self.decode_seconds if self.decode_seconds else 0.0

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


def positive_int(text: str) -> int:
    """An argparse type: a whole number >= 1."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def median_speed(results: list[GenerationResult]) -> GenerationResult:
    """The result of median decode speed (the lower middle one of an even count)."""
    return sorted(results, key=lambda r: r.decode_tokens_per_s)[(len(results) - 1) // 2]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, type=Path, help="target model directory (HF)")
    parser.add_argument("--draft", required=True, type=Path, help="DFlash drafter directory")
    parser.add_argument("--budgets", type=parse_budgets, default=[4, 8, 15, 32, 64])
    parser.add_argument("--max-new-tokens", type=positive_int, default=256)
    parser.add_argument("--prompts", type=positive_int, default=8, help="held-out prompts to run")
    parser.add_argument(
        "--repeats",
        type=positive_int,
        default=1,
        help="decodes of each prompt per method; the one of median speed counts",
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


def summarise(tallies: dict[Method, Tally]) -> list[dict]:
    """One row per method: tau, decode tokens/s and speedup over the first (ar) row, and the
    round's cost in ar steps with the ms per round of each stage."""
    ar = next(iter(tallies.values()))
    return [
        {
            "method": method.name,
            "budget": method.budget,
            "tau": round(tally.tau, 3),
            "decode_tokens_per_s": round(tally.tokens_per_s, 2),
            "speedup": _ratio(tally.tokens_per_s, ar.tokens_per_s),
            "cost": _ratio(tally.round_ms, ar.round_ms),
            "round_ms": round(tally.round_ms, 3),
            "stage_ms": {stage: round(tally.stage_ms(stage), 3) for stage in ROUND_STAGES},
            "tokens": tally.tokens,
            "rounds": tally.rounds,
        }
        for method, tally in tallies.items()
    ]


def _ratio(value: float, base: float) -> float | None:
    return round(value / base, 3) if base else None


def format_table(rows: list[dict]) -> str:
    header = ("method", "tau", "tok/s", "speedup", "cost", "draft ms", "verify ms")
    lines = [
        f"{header[0]:<12}{header[1]:>8}{header[2]:>10}" + "".join(f"{h:>11}" for h in header[3:])
    ]
    for row in rows:
        label = f"{row['method']} {row['budget']}" if row["budget"] is not None else row["method"]
        speedup = f"{row['speedup']:.2f}x" if row["speedup"] is not None else "-"
        cost = f"{row['cost']:.2f}" if row["cost"] is not None else "-"
        stages = row["stage_ms"]
        lines.append(
            f"{label:<12}{row['tau']:>8.2f}{row['decode_tokens_per_s']:>10.1f}{speedup:>11}"
            f"{cost:>11}{stages['draft']:>11.2f}{stages['verify']:>11.2f}"
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

    def decode(method: Method, prompt: list[int], max_new_tokens: int):
        cfg = GenerationConfig(
            method=method.name,
            budget=method.budget or 15,
            max_new_tokens=max_new_tokens,
            cuda_graphs=args.cuda_graphs,
        )
        with torch.inference_mode():
            return generate(target, drafter, prompt, cfg)

    for method in methods:
        decode(method, prompts[0], WARMUP_TOKENS)
    tallies = {method: Tally() for method in methods}
    for index, prompt in enumerate(prompts):
        runs: dict[Method, list[GenerationResult]] = {method: [] for method in methods}
        for _ in range(args.repeats):
            for method in methods:
                runs[method].append(decode(method, prompt, args.max_new_tokens))
        for method, results in runs.items():
            result = median_speed(results)
            tallies[method].add(
                result.acceptance_lengths, result.decode_tokens_per_s, result.stage_seconds
            )
        print(f"prompt {index + 1}/{len(prompts)} done ({len(prompt)} prompt tokens)", flush=True)
    close_target(target)
    rows = summarise(tallies)
    print(format_table(rows))
    print(
        json.dumps(
            {
                "model": str(args.model),
                "draft": str(args.draft),
                "prompts": len(prompts),
                "repeats": args.repeats,
                "max_new_tokens": args.max_new_tokens,
                "dtype": args.dtype,
                "device": args.device,
                "tp": args.tp,
                "cuda_graphs": args.cuda_graphs,
                "threads": torch.get_num_threads(),
                "results": rows,
            }
        )
    )
    return 0
