"""Host work of the scheduler's batched steps, load-free: aten ops a step and by part.

    python -m engine.tools.step_ops [--model DIR] [--draft DIR] [--method ddtree:15] \
        [--concurrency 6] [--max-tokens 96] [--json]

N chat requests at once (engine/tools/batching.py's prompts, greedy, the model's chat template)
through an N-slot scheduler in this process: one run to warm up, then a counted one. Every
aten op dispatched (views and casts included, engine/tools/ddtree_reference.py's `OpCount`) is
counted per call of each part below, and the means over the run's calls reported: a step (the
tail, where the batch thins, included), the target's batched pass, the drafter's, its context
write, a tree made from a draft, a sequence's commit (its walk), the caches' commit of a step's
rounds. On a machine whose speed wanders, these counts move only with the code; the seconds
they cost are measured elsewhere (engine/tools/batching.py against a server).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from contextlib import ExitStack, contextmanager
from functools import partial
from pathlib import Path

import torch

from engine.cache_pool import CachePool
from engine.decode import GenerationConfig, _Sequence
from engine.methods import METHODS
from engine.models import load_drafter, load_target
from engine.models.dflash import DFlashDrafter
from engine.scheduler import Request, Scheduler
from engine.tokenizer import load_tokenizer
from engine.tools.batching import TOPICS, parse_method
from engine.tools.ddtree_reference import OpCount

DEMO = Path(__file__).parents[1] / "demo_model"


def parts(target) -> dict[str, tuple[object, str]]:
    """The counted parts: name -> (owner, method name)."""
    return {
        "step": (Scheduler, "step"),
        "target_pass": (type(target), "forward_batch"),
        "draft_pass": (Scheduler, "_draft"),
        "context_write": (DFlashDrafter, "_write_contexts"),
        "tree": (_Sequence, "shape"),
        "commit": (_Sequence, "commit"),
        "cache_commit": (type(target), "commit_batch"),
    }


@contextmanager
def counting(owner: object, name: str, counts: list[int]):
    """`owner.name` counts each call's aten ops into `counts` while the context is open."""
    original = getattr(owner, name)

    def counted(*args, **kwargs):
        with OpCount() as count:
            result = original(*args, **kwargs)
        counts.append(count.ops)
        return result

    setattr(owner, name, counted)
    try:
        yield
    finally:
        setattr(owner, name, original)


def measure(args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    target, drafter = load_target(args.model), load_drafter(args.draft)
    tokenizer = load_tokenizer(args.model)
    method, budget = parse_method(args.method)
    cfg = GenerationConfig(
        method=method,
        budget=budget or 15,
        max_new_tokens=args.max_tokens,
        stop_token_ids=tuple(tokenizer.eos_token_ids),
    )
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": TOPICS[i % len(TOPICS)]}])
        for i in range(args.concurrency)
    ]
    pool = CachePool.for_server(target, drafter, args.slot_tokens, 0)
    scheduler = Scheduler(target, drafter, pool.slots(args.concurrency), args.batched_tokens)
    run = partial(run_at_once, scheduler, prompts, cfg)
    run()  # warm-up
    counts: dict[str, list[int]] = {name: [] for name in parts(target)}
    with ExitStack() as stack:
        for name, (owner, method_name) in parts(target).items():
            stack.enter_context(counting(owner, method_name, counts[name]))
        tokens = run()
    return {
        "ops": {name: round(statistics.mean(c), 1) for name, c in counts.items() if c},
        "calls": {name: len(c) for name, c in counts.items()},
        "tokens": tokens,
        "settings": {
            "method": args.method,
            "concurrency": args.concurrency,
            "max_tokens": args.max_tokens,
        },
    }


def run_at_once(scheduler: Scheduler, prompts: list[list[int]], cfg: GenerationConfig) -> int:
    """Every prompt added at once, the scheduler stepped until idle; the tokens generated."""
    finished: list = []
    for prompt in prompts:
        scheduler.add(Request(list(prompt), cfg, on_finish=finished.append))
    with torch.inference_mode():
        while not scheduler.idle:
            scheduler.step()
    failed = [f.error for f in finished if f.error is not None]
    if failed:
        raise failed[0]
    return sum(len(f.result.output_ids) for f in finished)


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def main(argv: list[str] | None = None, out: Callable[[str], None] = print) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=DEMO / "target")
    parser.add_argument("--draft", type=Path, default=DEMO / "draft")
    parser.add_argument("--method", default="ddtree:15", help="ar, linear, ddtree:N or auto")
    parser.add_argument("--concurrency", type=positive, default=6)
    parser.add_argument("--max-tokens", type=positive, default=96)
    parser.add_argument("--batched-tokens", type=positive, default=256)
    parser.add_argument("--slot-tokens", type=positive, default=1024)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    try:
        method, budget = parse_method(args.method)
    except ValueError:
        method, budget = None, None
    if method not in METHODS or (budget is not None and budget < 1):
        print(f"Error: --method {args.method!r}: not ar, linear, ddtree:N or auto", file=sys.stderr)
        return 2
    if not (args.model / "config.json").is_file() or not (args.draft / "config.json").is_file():
        print("Error: --model and --draft must be model directories", file=sys.stderr)
        return 2
    report = measure(args)
    if args.json:
        out(json.dumps(report, indent=2))
    else:
        for name, ops in report["ops"].items():
            out(f"{name:14s} {ops:9.1f} aten ops a call ({report['calls'][name]} calls)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
