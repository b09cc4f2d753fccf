"""Batched decoding at Qwen3.6-27B's layer widths, random weights: what the scheduler gets from a
GPU at concurrency 1, 4, 8 and 16, and what a verify pass costs by its token count.

With a target of `layers` layers and of twice as many (engine/tools/gpu_rounds.py `random_pair`:
the real widths and vocabulary, a one-layer DFlash drafter), each method (ar, ddtree:15, and
`auto` where engine.methods has it) runs `concurrency` requests at once through the scheduler
(engine/scheduler.py: one target pass a step over every running sequence), each a distinct
random `prefix`-token prompt and `new_tokens` greedy tokens, no prefix cache. Per run:
- aggregate tok/s: the tokens every sequence emitted while all of them were decoding (from the
  last one's first token to the first one's last) over that window;
- inter-token latency: each sequence's mean gap between its tokens after the first (the
  server's ddops_engine_inter_token_seconds), the median and the worst over the sequences;
and the verify cost table: the median time of every decode pass (no prefill piece in it) by
(sequences, tokens): "batched", the target's `forward_batch` (what `auto`'s cost model times,
engine/budgets.py); "solo", the verify of a sequence decoding alone, which the scheduler runs
by generate()'s static passes (CUDA graphs); "graphed", a plain step of n sequences (every
one its token alone: ar) or a tree step (engine/tree_passes.py) replayed as its bucket's CUDA
graph (engine/step_passes.py). On CUDA ar and the tree methods also run with those graphs and
the drafts' (engine/draft_passes.py) off ("ar eager", "ddtree:15 eager": `forward_batch`,
`draft_batch`), to show what they save.
CUDA events on the stream, so nothing waits for them; the CPU's clock elsewhere. Each figure is also given at Qwen3.6-27B's 64 layers,
from the straight line through the two stacks (per layer; the drafter is in the intercept).
And the host syncs of a step while max(concurrency) sequences decode, the most of any step
(torch.cuda.set_sync_debug_mode, in a run of its own: the mode's checks cost time): each
sequence's choices and each budget's drafts are read, so about one a sequence and none a layer.
Random weights accept about one drafted token a round, so ddtree's tok/s here is its cost
without its gain: the table and the ar figures are what carry over to trained weights.

    python -m engine.tools.gpu_batched [--layers 4] [--prefix 4096] [--new-tokens 64] \\
        [--concurrency 1,4,8,16] [--methods ar,ddtree:15,auto] [--json]   # CUDA, via gpu_check
    python -m engine.tools.gpu_batched --device cpu --tiny    # tiny widths on the CPU (tests)

`check_batched(device, ...)` returns the report as a dict for engine/tools/gpu_check.py.
Exit status: 0 measured, 2 bad arguments or no CUDA device where one was asked for.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from engine.cache_pool import CachePool
from engine.decode import GenerationConfig, _Sequence
from engine.methods import METHODS
from engine.scheduler import Finished, Request, Scheduler
from engine.step_passes import StepPasses
from engine.tools.arguments import positive_int
from engine.tools.gpu_rounds import FULL_LAYERS, counted_syncs, per_layer_fit, random_pair

CONCURRENCY = (1, 4, 8, 16)
NEW_TOKENS = 64
PREFIX = 4096
WARM_TOKENS = 4  # a warm-up request per method first: Triton compiles outside the figures
SYNC_TOKENS = 8  # each request's tokens while a step's host syncs are counted


def default_methods() -> tuple[str, ...]:
    """ar, ddtree:15, and auto once the engine has it (engine/methods.py)."""
    return ("ar", "ddtree:15") + (("auto",) if "auto" in METHODS else ())


def method_config(method: str, new_tokens: int) -> GenerationConfig:
    """`ar`, `NAME:BUDGET` (ddtree:15, linear:15, auto:15) or a bare name (budget 15): greedy,
    `new_tokens` tokens whatever they are (no stop tokens)."""
    name, _, budget = method.partition(":")
    if name not in METHODS or (budget and not budget.isdigit()) or budget == "0":
        raise ValueError(
            f"not a method: {method!r} (e.g. ar, ddtree:15; from {', '.join(METHODS)})"
        )
    return GenerationConfig(method=name, budget=int(budget or 15), max_new_tokens=new_tokens)


class PassTimes:
    """Times the target's passes while installed, by (path, sequences, tokens): "batched", each
    `forward_batch` whose segments are all alike (no prefill piece, every sequence the same
    token count: a batch of ar steps or of 16-token trees); "solo", each verify of a sequence
    decoding alone, which the scheduler runs by `generate`'s static passes (engine/decode.py
    `_Sequence.verify`, its choice included; an `auto` one keeps the batched pass). On CUDA as
    events recorded on the stream, read at `table`."""

    def __init__(self, target, steps: StepPasses | None = None, trees=None) -> None:
        self.target, self.batch = target, target.forward_batch
        self.graphed = [passes for passes in (steps, trees) if passes is not None]
        self.cuda = next(target.parameters()).device.type == "cuda"
        self.samples: dict[tuple[str, int, int], list] = defaultdict(list)
        self.solo_verify = _Sequence.verify

    def __enter__(self) -> PassTimes:
        def batched(segments, hidden_layers=()):
            lengths = {segment.ids.shape[0] for segment in segments}
            decode = len(lengths) == 1 and not any(segment.extend for segment in segments)
            key = ("batched", len(segments), len(segments) * lengths.pop()) if decode else None
            return self._timed(key, self.batch, segments, hidden_layers)

        def solo(seq, tree):
            return self._timed(("solo", 1, tree.size + 1), self.solo_verify, seq, tree)

        self.target.forward_batch = batched
        _Sequence.verify = solo
        for passes in self.graphed:  # a plain step's (bonuses) or a tree step's (ids)
            graphed = passes.run

            def step(ids, segments, hidden_layers, graphed=graphed):
                tokens = sum(segment.ids.shape[0] for segment in segments)
                key = ("graphed", len(segments), tokens)
                return self._timed(key, graphed, ids, segments, hidden_layers)

            passes.run = step
        return self

    def __exit__(self, *exc) -> None:
        del self.target.forward_batch  # the class's method again
        _Sequence.verify = self.solo_verify
        for passes in self.graphed:
            del passes.run

    def _timed(self, key, call, *args):
        """call(*args), timed under `key` (None: not timed)."""
        if key is None:
            return call(*args)
        if self.cuda:
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            outputs = call(*args)
            end.record()
            self.samples[key].append((start, end))
            return outputs
        started = time.perf_counter()
        outputs = call(*args)
        self.samples[key].append(1000 * (time.perf_counter() - started))
        return outputs

    def table(self) -> dict[tuple[str, int, int], float]:
        """Median ms of a pass by (path, sequences, tokens)."""
        if self.cuda:
            torch.cuda.synchronize()

        def ms(sample) -> float:
            return sample if isinstance(sample, float) else sample[0].elapsed_time(sample[1])

        return {key: statistics.median(map(ms, found)) for key, found in self.samples.items()}


@dataclass
class Emissions:
    """One request's tokens as they came: (time.perf_counter(), how many) per emission."""

    marks: list[tuple[float, int]] = field(default_factory=list)

    def add(self, tokens: list[int]) -> None:
        self.marks.append((time.perf_counter(), len(tokens)))

    @property
    def first(self) -> float:
        return self.marks[0][0]

    @property
    def last(self) -> float:
        return self.marks[-1][0]

    @property
    def itl_ms(self) -> float:
        """Mean ms between its tokens after the first."""
        after = sum(count for _, count in self.marks) - 1
        return 1000 * (self.last - self.first) / after if after > 0 else float("nan")

    def within(self, start: float, end: float) -> int:
        return sum(count for at, count in self.marks if start < at <= end)


def run_batch(scheduler: Scheduler, cfg: GenerationConfig, prompts: list[list[int]]) -> dict:
    """`prompts` decoded at once: aggregate tok/s over the window all of them decoded in, and
    each sequence's inter-token latency (median and worst)."""
    streams = [Emissions() for _ in prompts]
    done: list[Finished] = []
    for prompt, stream in zip(prompts, streams, strict=True):
        scheduler.add(Request(prompt, cfg, on_tokens=stream.add, on_finish=done.append))
    with torch.inference_mode():
        while not scheduler.idle:
            scheduler.step()
    if failed := [f.error for f in done if f.error is not None]:
        raise failed[0]
    start, end = max(s.first for s in streams), min(s.last for s in streams)
    if len(streams) == 1:
        start = streams[0].first  # alone: its whole decode after the first token
    tokens = sum(s.within(start, end) for s in streams)
    itl = [s.itl_ms for s in streams]
    return {
        "tokens_per_s": tokens / (end - start) if end > start else float("nan"),
        "itl_ms_p50": statistics.median(itl),
        "itl_ms_max": max(itl),
        "window_tokens": tokens,
    }


def step_syncs(scheduler: Scheduler, cfg: GenerationConfig, prompts: list[list[int]]) -> int | None:
    """The most host syncs (torch's sync debug mode) a step made while every one of `prompts`
    decoded (None off CUDA). A step reads each sequence's choices and each budget's drafts:
    about one a sequence, none a layer."""
    if scheduler.target.embed_tokens.weight.device.type != "cuda":
        return None
    for prompt in prompts:
        scheduler.add(Request(prompt, cfg))
    most = 0
    with torch.inference_mode():
        while not scheduler.idle:
            decoding = not scheduler.waiting and not any(a.prefilling for a in scheduler.running)
            with counted_syncs() as caught:
                scheduler.step()
            if decoding and len(scheduler.running) == len(prompts):
                most = max(most, len(caught))
    return most


def measure(target, drafter, methods, concurrency, prefix: int, new_tokens: int) -> dict:
    """Every (method, concurrency) run on one pool of max(concurrency) slots, and the passes'
    table; a warm-up request per method first."""
    vocab = target.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, vocab - 1, (max(concurrency), prefix), generator=generator).tolist()
    slot = prefix + new_tokens + 2 * (drafter.block_size if drafter is not None else 1)
    pool = CachePool.for_server(target, drafter, slot, 0)
    scheduler = Scheduler(target, drafter, pool.slots(max(concurrency)))
    for method in methods:
        run_batch(scheduler, method_config(method, WARM_TOKENS), prompts[:1])
    runs = {}
    with PassTimes(target, scheduler.steps, scheduler.trees) as passes:
        for method in methods:
            cfg = method_config(method, new_tokens)
            for level in concurrency:
                runs[method, level] = run_batch(scheduler, cfg, prompts[:level])
        if scheduler.steps is not None:  # the steps and the drafts not graphed
            graphed = scheduler.steps, scheduler.trees, scheduler.drafts
            scheduler.steps = scheduler.trees = scheduler.drafts = None
            for method in [method for method in methods if not method.startswith("auto")]:
                cfg = method_config(method, new_tokens)
                for level in concurrency:
                    runs[f"{method} eager", level] = run_batch(scheduler, cfg, prompts[:level])
            scheduler.steps, scheduler.trees, scheduler.drafts = graphed
    most = prompts[: max(concurrency)]  # counted apart: the debug mode's checks cost time
    syncs = {m: step_syncs(scheduler, method_config(m, SYNC_TOKENS), most) for m in methods}
    return {"runs": runs, "passes": passes.table(), "syncs": syncs}


def check_batched(
    device: torch.device,
    dtype: torch.dtype = torch.bfloat16,
    layers: int = 4,
    prefix: int = PREFIX,
    new_tokens: int = NEW_TOKENS,
    concurrency: tuple[int, ...] = CONCURRENCY,
    methods: tuple[str, ...] | None = None,
    tiny: bool = False,
) -> dict:
    """The report (see the module docstring): `rows` per method and concurrency, `verify_ms` per
    (sequences, tokens), each at `layers`, 2 x `layers` and FULL_LAYERS (fitted)."""
    methods = methods or default_methods()
    for method in methods:
        method_config(method, new_tokens)  # a bad name fails before anything is built
    started = time.monotonic()
    measured = {}
    for count in (layers, 2 * layers):
        target, drafter = random_pair(device, dtype, count, tiny)
        measured[count] = measure(target, drafter, methods, concurrency, prefix, new_tokens)
        del target, drafter
        if device.type == "cuda":
            torch.cuda.empty_cache()
    small, large = measured[layers], measured[2 * layers]

    def fit(at_small: float, at_large: float) -> float | None:
        """At FULL_LAYERS; None where the deeper stack measured faster (noise: no slope)."""
        value = per_layer_fit(at_small, layers, at_large, 2 * layers, FULL_LAYERS)
        return value if value > 0 else None

    rows = []
    for (method, level), one in small["runs"].items():
        two = large["runs"][method, level]
        itl = fit(one["itl_ms_p50"], two["itl_ms_p50"])
        rows.append(
            {
                "method": method,
                "concurrency": level,
                f"tokens_per_s_{layers}": one["tokens_per_s"],
                f"tokens_per_s_{2 * layers}": two["tokens_per_s"],
                f"itl_ms_p50_{layers}": one["itl_ms_p50"],
                f"itl_ms_p50_{2 * layers}": two["itl_ms_p50"],
                f"itl_ms_max_{layers}": one["itl_ms_max"],
                "itl_ms_p50_64": itl,
                "tokens_per_s_64": level * 1000 / itl if itl else None,
            }
        )
    verify = [
        {
            "path": path,
            "sequences": sequences,
            "tokens": tokens,
            f"ms_{layers}": ms,
            f"ms_{2 * layers}": large["passes"][path, sequences, tokens],
            "ms_64": fit(ms, large["passes"][path, sequences, tokens]),
        }
        for (path, sequences, tokens), ms in sorted(small["passes"].items(), key=_by_tokens)
        if (path, sequences, tokens) in large["passes"]
    ]
    return {
        "device": str(device) if device.type != "cuda" else torch.cuda.get_device_name(device),
        "dtype": str(dtype).removeprefix("torch."),
        "layers": layers,
        "prefix": prefix,
        "new_tokens": new_tokens,
        "tiny": tiny,
        "rows": rows,
        "verify_ms": verify,
        "step_syncs": {"sequences": max(concurrency), "most": small["syncs"]},
        "seconds": round(time.monotonic() - started, 1),
    }


def _by_tokens(item) -> tuple:
    (path, sequences, tokens), _ = item
    return tokens, sequences, path


def print_batched(report: dict) -> None:
    L, L2 = report["layers"], 2 * report["layers"]
    shape = "tiny widths" if report["tiny"] else "Qwen3.6-27B widths"
    print(
        f"batched ({report['device']}, {report['dtype']}, {shape}, {L} and {L2} layers, "
        f"{report['prefix']}-token prompts, {report['new_tokens']} new tokens, "
        f"{report['seconds']} s); 64 layers fitted:"
    )
    print(f"  {'method':<10} {'seqs':>4} {'tok/s':>10} {'ITL p50 ms':>11} {'ITL max':>9}"
          f" {'tok/s@64':>10} {'ITL@64 ms':>10}")  # fmt: skip
    for row in report["rows"]:
        print(
            f"  {row['method']:<10} {row['concurrency']:>4} {row[f'tokens_per_s_{L}']:>10.1f} "
            f"{row[f'itl_ms_p50_{L}']:>11.2f} {row[f'itl_ms_max_{L}']:>9.2f} "
            f"{_figure(row['tokens_per_s_64'], 1)} {_figure(row['itl_ms_p50_64'], 2)}"
        )
    syncs = report["step_syncs"]
    if any(most is not None for most in syncs["most"].values()):
        counts = ", ".join(f"{method} {most}" for method, most in syncs["most"].items())
        print(f"  host syncs a step of {syncs['sequences']} decoding, most: {counts}")
    print(
        "  verify pass by token count, median ms (batched: forward_batch; solo: a lone verify;"
        " graphed: a plain or tree step's graph):"
    )
    print(
        f"  {'path':<8} {'seqs':>6} {'tokens':>7} {f'{L} layers':>10} {f'{L2} layers':>10} "
        f"{'64 layers':>10}"
    )
    for row in report["verify_ms"]:
        print(
            f"  {row['path']:<8} {row['sequences']:>6} {row['tokens']:>7} {row[f'ms_{L}']:>10.3f} "
            f"{row[f'ms_{L2}']:>10.3f} {_figure(row['ms_64'], 3)}"
        )


def _figure(value: float | None, places: int) -> str:
    return f"{'-':>10}" if value is None else f"{value:>10.{places}f}"


def _counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        counts = ()
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"a comma-separated list of counts >= 1, not {text!r}")
    return counts


def _methods(text: str) -> tuple[str, ...]:
    methods = tuple(text.split(","))
    try:
        for method in methods:
            method_config(method, 1)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return methods


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--tiny", action="store_true", help="tiny widths (a CPU test's run)")
    parser.add_argument("--layers", type=positive_int, default=4, help="the smaller stack's layers")
    parser.add_argument("--prefix", type=positive_int, default=PREFIX, help="prompt tokens")
    parser.add_argument("--new-tokens", type=positive_int, default=NEW_TOKENS)
    parser.add_argument("--concurrency", type=_counts, default=CONCURRENCY)
    parser.add_argument("--methods", type=_methods, help="default: ar,ddtree:15 (and auto)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_batched: no CUDA device (--device cpu --tiny runs on the CPU)", file=sys.stderr)
        return 2
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    report = check_batched(
        torch.device(args.device), dtype, args.layers, args.prefix, args.new_tokens,
        args.concurrency, args.methods, args.tiny,
    )  # fmt: skip
    if args.json:
        print(json.dumps(report))
    else:
        print_batched(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
