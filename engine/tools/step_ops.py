"""Host work of the scheduler's batched steps, load-free: aten ops a step and by part.

    python -m engine.tools.step_ops [--model DIR] [--draft DIR] [--method ddtree:15] \
        [--concurrency 6] [--max-tokens 96] [--json]
    python -m engine.tools.step_ops --random-layers 64 --dtype bfloat16 --cuda-launches \
        --concurrency 16

N chat requests at once (engine/tools/batching.py's prompts, greedy, the model's chat template)
through an N-slot scheduler in this process: one run to warm up, then a counted one. Every
aten op dispatched (views and casts included, engine/tools/ddtree_reference.py's `OpCount`) is
counted per call of each part below, and the means over the run's calls reported: a step (the
tail, where the batch thins, included) and one in which every sequence decodes, the target's
batched pass and one of decode rounds alone (no prefill piece), the drafter's, its context
write, a tree made from a draft, a sequence's commit (its walk), the caches' commit of a step's
rounds. On a machine whose speed wanders, these counts move only with the code; the seconds
they cost are measured elsewhere (engine/tools/batching.py against a server).

What a GPU's eager steps dispatch at Qwen3.6-27B's size, counted on the CPU: `--random-layers N`
runs a random pair of N target layers at its layer layout (every fourth full attention,
tiny widths: engine/tools/gpu_rounds.py `random_pair`, in --dtype: bfloat16 as served, where
the casts to float32 are kernels) on random 64-token prompts instead of --model/--draft, and
`--cuda-launches` counts as CUDA runs a batched pass: every segment's attention in one paged
launch (kv_blocks.PagedSequences), and each call of a kernel that has a
Triton form (the attention, RMSNorm, RoPE, SiLU-multiply: engine/kernels) one op, as its launch
is one (the CPU's plain torch makes several; its paged attention loops over the sequences).
A plain step (ar) and a tree step are then what they cost with their CUDA graphs off; with
`--graphs` the scheduler runs them and its drafts by their buckets' static passes
(engine/step_passes.py, engine/tree_passes.py, engine/draft_passes.py), each pass counted as
the one op of its graph's replay: what is left is the host work around the graphs (filling
their buffers, the trees, the commits' K/V).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import replace
from functools import partial
from pathlib import Path
from types import ModuleType

import torch
from torch.utils._python_dispatch import _disable_current_modes

from engine import kernels
from engine.cache_pool import CachePool
from engine.decode import GenerationConfig, StaticPass, _Sequence
from engine.draft_passes import DraftPasses
from engine.methods import METHODS
from engine.models import common, load_drafter, load_target
from engine.models.common import Segment
from engine.models.dflash import DFlashDrafter
from engine.scheduler import Scheduler
from engine.step_passes import StepPasses
from engine.tools.arguments import positive_int
from engine.tools.batch_ties import demo_prompts, outputs
from engine.tools.batching import parse_method
from engine.tools.ddtree_reference import OpCount
from engine.tools.gpu_rounds import random_pair
from engine.tree_passes import TreePasses

DEMO = Path(__file__).parents[1] / "demo_model"
RANDOM_PROMPT = 64  # --random-layers' prompts' tokens
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # --random-layers' weights


def parts(target, graphs: bool) -> dict[str, tuple[object, str, Callable[..., bool] | None]]:
    """The counted parts: name -> (owner, method name, which calls count: all when None);
    with `graphs` the static passes' steps too (filled, replayed, left for commit)."""
    static = {
        "plain_step_pass": (StepPasses, "run", None),
        "tree_step_pass": (TreePasses, "run", None),
        "tree_step_commit": (TreePasses, "commit", None),
        "draft_step_pass": (DraftPasses, "run", None),
    }
    return {
        "step": (Scheduler, "step", None),
        "decode_step": (Scheduler, "step", all_decoding),
        "target_pass": (type(target), "forward_batch", None),
        "decode_pass": (type(target), "forward_batch", no_piece),
        "draft_pass": (Scheduler, "_draft", None),
        "context_write": (DFlashDrafter, "_write_contexts", None),
        "tree": (_Sequence, "shape", None),
        "commit": (_Sequence, "commit", None),
        "cache_commit": (type(target), "commit_batch", None),
        **(static if graphs else {}),
    }


def all_decoding(scheduler: Scheduler) -> bool:
    """A step in which every sequence decodes (none waits, none prefills)."""
    return not scheduler.waiting and not any(active.prefilling for active in scheduler.running)


def no_piece(target, segments: list[Segment], *args, **kwargs) -> bool:
    """A batched pass of decode rounds only (no prefill piece)."""
    return not any(segment.extend for segment in segments)


@contextmanager
def counting(owner: object, name: str, counts: list[int], which: Callable[..., bool] | None):
    """`owner.name` counts each call's aten ops into `counts` while the context is open (only
    the calls `which` takes, given the call's arguments before it runs)."""
    original = getattr(owner, name)

    def counted(*args, **kwargs):
        if which is not None and not which(*args, **kwargs):
            return original(*args, **kwargs)
        with OpCount() as count:
            result = original(*args, **kwargs)
        counts.append(count.ops)
        return result

    setattr(owner, name, counted)
    try:
        yield
    finally:
        setattr(owner, name, original)


class OneLaunch:
    """A kernel module whose every function counts as one op (its Triton kernel's one launch):
    it runs with the counting modes off (torch's private switch, from the module of the
    TorchDispatchMode that OpCount is), then dispatches one empty tensor."""

    def __init__(self, module: ModuleType) -> None:
        self.module = module

    def __getattr__(self, name: str) -> Callable:
        kernel = getattr(self.module, name)

        return partial(as_one_op, kernel)


def as_one_op(call: Callable, *args, **kwargs):
    """`call` run with the counting modes off (the CPU's own ops), then one empty tensor
    dispatched: the one op counted, as a Triton kernel's launch or a CUDA graph's replay is."""
    with _disable_current_modes():
        out = call(*args, **kwargs)
    torch.empty(0)
    return out


def graphed(scheduler: Scheduler) -> None:
    """The scheduler's plain and tree steps and its drafts by their buckets' static passes, as
    on CUDA, each pass's run counted as its graph's one replay (`as_one_op`)."""
    target, drafter = scheduler.target, scheduler.drafter
    scheduler.steps = StepPasses(target, graphs=False)
    most = scheduler.max_num_seqs
    scheduler.trees = TreePasses(target, graphs=False, most=most)
    scheduler.drafts = DraftPasses(drafter, target, graphs=False, most=most) if drafter else None
    for passes in filter(None, (scheduler.steps, scheduler.trees, scheduler.drafts)):
        passes.filled = partial(_replayed, passes.filled)


def _replayed(filled: Callable, *args):
    made = filled(*args)  # a StaticPass, or a tree step's bucket (its verify and commit)
    if isinstance(made, StaticPass):
        return partial(as_one_op, made)
    commit = made.commit and partial(as_one_op, made.commit)
    return replace(made, verify=partial(as_one_op, made.verify), commit=commit)


@contextmanager
def cuda_launches() -> Iterator[None]:
    """Batched passes dispatch as on CUDA (see the module docstring): every segment's attention
    in one paged launch, and every call of a kernel with a Triton form (engine/kernels: the
    tree kernels, RMSNorm, RoPE, SiLU-multiply) one op."""
    chosen = (kernels._implementation, kernels._fused_implementation)

    def implementation(name: str, tensor: torch.Tensor) -> OneLaunch:
        return OneLaunch(chosen[0](name, tensor))

    def fused_implementation(*tensors: torch.Tensor) -> OneLaunch:
        return OneLaunch(chosen[1](*tensors))

    devices = common.ONE_LAUNCH_DEVICES
    common.ONE_LAUNCH_DEVICES = (*devices, "cpu")
    kernels._implementation, kernels._fused_implementation = implementation, fused_implementation
    try:
        yield
    finally:
        common.ONE_LAUNCH_DEVICES = devices
        kernels._implementation, kernels._fused_implementation = chosen


def models_and_prompts(args: argparse.Namespace) -> tuple:
    """The target, the drafter, the concurrency's prompts and their stop tokens: the chat
    prompts of --model's tokenizer, or with --random-layers random ones of RANDOM_PROMPT tokens
    (no stop token)."""
    if args.random_layers:
        with torch.random.fork_rng():  # the same weights, so the same drafts, every run
            torch.manual_seed(0)
            target, drafter = random_pair(
                torch.device("cpu"), DTYPES[args.dtype], args.random_layers, True
            )
        generator = torch.Generator().manual_seed(0)
        shape = (args.concurrency, RANDOM_PROMPT)
        prompts = torch.randint(0, target.config.vocab_size - 1, shape, generator=generator)
        return target, drafter, prompts.tolist(), ()
    target, drafter = load_target(args.model), load_drafter(args.draft)
    return target, drafter, *demo_prompts(args.model, args.concurrency)


def measure(args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    target, drafter, prompts, stops = models_and_prompts(args)
    method, budget = parse_method(args.method)
    cfg = GenerationConfig(
        method=method, budget=budget or 15, max_new_tokens=args.max_tokens, stop_token_ids=stops
    )
    pool = CachePool.for_server(target, drafter, args.slot_tokens, 0)
    scheduler = Scheduler(target, drafter, pool.slots(args.concurrency), args.batched_tokens)
    if args.graphs:
        graphed(scheduler)
    run = partial(run_at_once, scheduler, prompts, cfg)
    counted = parts(target, args.graphs)
    counts: dict[str, list[int]] = {name: [] for name in counted}
    with ExitStack() as stack:
        if args.cuda_launches:
            stack.enter_context(cuda_launches())
        run()  # warm-up
        for name, (owner, method_name, which) in counted.items():
            stack.enter_context(counting(owner, method_name, counts[name], which))
        tokens = run()
    return {
        "ops": {name: round(statistics.mean(c), 1) for name, c in counts.items() if c},
        "calls": {name: len(c) for name, c in counts.items()},
        "tokens": tokens,
        "settings": {
            "method": args.method,
            "concurrency": args.concurrency,
            "max_tokens": args.max_tokens,
            "random_layers": args.random_layers,
            "dtype": args.dtype,
            "cuda_launches": args.cuda_launches,
            "graphs": args.graphs,
        },
    }


def run_at_once(scheduler: Scheduler, prompts: list[list[int]], cfg: GenerationConfig) -> int:
    """Every prompt added at once, the scheduler stepped until idle; the tokens generated."""
    return sum(len(ids) for ids in outputs(scheduler, prompts, cfg))


def main(argv: list[str] | None = None, out: Callable[[str], None] = print) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=DEMO / "target")
    parser.add_argument("--draft", type=Path, default=DEMO / "draft")
    parser.add_argument("--method", default="ddtree:15", help="ar, linear, ddtree:N or auto")
    parser.add_argument("--concurrency", type=positive_int, default=6)
    parser.add_argument("--max-tokens", type=positive_int, default=96)
    parser.add_argument("--batched-tokens", type=positive_int, default=256)
    parser.add_argument("--slot-tokens", type=positive_int, default=1024)
    parser.add_argument(
        "--random-layers", type=positive_int, help="a random pair of this many layers"
    )
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="its weights'")
    parser.add_argument("--cuda-launches", action="store_true", help="count attention as CUDA")
    parser.add_argument("--graphs", action="store_true", help="steps as replayed CUDA graphs")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    try:
        method, budget = parse_method(args.method)
    except ValueError:
        method, budget = None, None
    if method not in METHODS or (budget is not None and budget < 1):
        print(f"Error: --method {args.method!r}: not ar, linear, ddtree:N or auto", file=sys.stderr)
        return 2
    models = (args.model / "config.json").is_file() and (args.draft / "config.json").is_file()
    if not args.random_layers and not models:
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
