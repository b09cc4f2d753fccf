"""Our ddtree decode speed and trees beside the public DDTree reference's, in one process, on the CPU.

    python -m engine.tools.ddtree_reference --reference DIR --model TARGET --draft DRAFT \
        [--prompts 4] [--prompt-chars 400] [--max-new-tokens 256] [--budget 15] [--repeats 6] \
        [--clock wall|cpu] [--json OUT]

DIR is a checkout of github.com/liranringel/ddtree: its `ddtree_generate` is imported from
there and run as it is (nothing of it lives in this repository). It runs transformers models, so
the pair must be one transformers loads: a dense Qwen3 target (its tree mask does not isolate
branches inside a hybrid's GDN layers) and a z-lab-layout DFlash drafter whose target layers
leave out the last one (transformers' last hidden state is normed): `python -m engine
train-demo --dense --out DIR` trains such a pair. Both engines get the same
prompt ids (held-out prompts, engine/data/corpus.py, no chat template), greedy, no stop token,
the same dtype and torch threads. Each repeat runs every prompt through both, the order
alternating from one prompt and repeat to the next, so the machine's load lands on both alike.

Decode tok/s, one definition for both: the tokens after the first over the seconds from the
end of the prefill to the end of the last round (ours: GenerationResult.decode_tokens_per_s;
the reference's: its round clock's last stamp; its own figure starts its clock after the first
draft and counts the first token, so it is printed beside as `reference_own`). A ratio is ours
over the reference's of one prompt in one repeat; the report gives their median and interval
(engine.bench_stats), with each engine's stage milliseconds per token as medians, in its own
stage names: ours prefill, draft, tree, verify, commit; the reference's draft (without its
first, over the prompt), tree_build (and its parts), tree_compile, verify, commit. Trees: a
traced run of each prompt compares every round's tree (tokens, parents) and accepted path;
the rounds where ours has shrunk its tree to stay within max_new_tokens (the reference does
not) are counted apart.

Host work, a load-free measure beside the times: `ops_per_round`, each engine's aten ops (every
torch op dispatched, views and casts included) per round of a traced run of the first prompt.

`--clock cpu` times both by this thread's CPU time instead of the wall clock (see `clock`): on
a machine busy with other work, the wall clock mostly measures the waits for a core.

On a machine without CUDA the reference's synchronisations are no-ops; the modules it imports
only for its datasets and logging (`datasets`, `loguru`) are stand-ins when not installed.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
import types
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine.bench_stats import interval_name, median_interval
from engine.data.corpus import held_out_prompts
from engine.decode import GenerationConfig, generate
from engine.models import load_drafter, load_target
from engine.tokenizer import load_tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _stand_in_modules() -> None:
    """Importable stand-ins for what the reference imports but a decode never calls."""
    try:
        import loguru  # noqa: F401
    except ImportError:
        stand_in = types.ModuleType("loguru")
        stand_in.logger = logging.getLogger("ddtree_reference")
        sys.modules["loguru"] = stand_in
    try:
        import datasets  # noqa: F401
    except ImportError:
        stand_in = types.ModuleType("datasets")
        for name in ("load_dataset", "Features", "Sequence", "Value"):
            setattr(stand_in, name, None)
        sys.modules["datasets"] = stand_in
    if not torch.cuda.is_available():
        torch.cuda.synchronize = lambda *args, **kwargs: None


class Reference:
    """The reference's ddtree_generate over transformers models loaded from the same pair."""

    def __init__(self, checkout: Path, model: Path, draft: Path, dtype: torch.dtype) -> None:
        from transformers import AutoModelForCausalLM

        _stand_in_modules()
        sys.path.insert(0, str(checkout))
        from ddtree import ddtree_generate
        from model import DFlashDraftModel

        self._generate = ddtree_generate
        attention = {"attn_implementation": "sdpa", "dtype": dtype}
        self.target = AutoModelForCausalLM.from_pretrained(model, **attention).eval()
        self.drafter = DFlashDraftModel.from_pretrained(draft, **attention).eval()

    def run(self, prompt_ids: list[int], budget: int, new_tokens: int, trace: bool = False):
        result = self._generate(
            model=self.drafter,
            target=self.target,
            input_ids=torch.tensor([prompt_ids]),
            mask_token_id=self.drafter.mask_token_id,
            max_new_tokens=new_tokens,
            block_size=self.drafter.block_size,
            stop_token_ids=None,
            temperature=0.0,
            tree_budget=budget,
            save_tree_traces=trace,
        )
        tokens = result.num_output_tokens
        seconds = result.round_timestamps[-1]
        return {
            "tok_s": (tokens - 1) / seconds,
            "own_tok_s": 1 / result.time_per_output_token,
            "output": result.output_ids[0, len(prompt_ids) :].tolist(),
            "rounds": result.round_trees,
            "stage_ms_per_token": per_token(result.stage_times, tokens - 1),
        }


class Ours:
    def __init__(self, model: Path, draft: Path, dtype: torch.dtype) -> None:
        self.target = load_target(model, dtype=dtype)
        self.drafter = load_drafter(draft, dtype=dtype)

    def run(self, prompt_ids: list[int], budget: int, new_tokens: int, trace: bool = False):
        cfg = GenerationConfig(
            method="ddtree", budget=budget, max_new_tokens=new_tokens, trace=trace
        )
        with torch.inference_mode():
            result = generate(self.target, self.drafter, prompt_ids, cfg)
        return {
            "tok_s": result.decode_tokens_per_s,
            "output": result.output_ids,
            "rounds": result.rounds,
            "stage_ms_per_token": per_token(result.stage_seconds, len(result.output_ids) - 1),
        }


def per_token(stage_seconds: dict[str, float], tokens: int) -> dict[str, float]:
    """Each stage's milliseconds per decoded token."""
    return {name: 1000 * seconds / max(tokens, 1) for name, seconds in stage_seconds.items()}


def compare_trees(ours: list[dict], reference: list[dict], depth: int, new_tokens: int) -> dict:
    """Rounds whose tree and accepted path equal the reference's, the first that does not, and
    how many rounds of ours drafted fewer than `depth` positions to stay within `new_tokens`
    (the reference drafts past the end and cuts the output afterwards)."""
    same, first_difference, shrunk, produced = 0, None, 0, 1  # the prefill's token
    for index, (mine, theirs) in enumerate(zip(ours, reference, strict=False)):
        room = new_tokens - produced - 1  # ours keeps one token for the round's bonus
        produced += len(mine["accepted"]) + 1
        if room < depth:
            shrunk += 1
            continue
        equal = (
            mine["tree"]["tokens"] == theirs["tree"]["node_token_ids"]
            and mine["tree"]["parents"] == theirs["tree"]["parents"][1:]
            and mine["accepted"] == theirs["accepted_indices"][1:]
        )
        if equal:
            same += 1
        elif first_difference is None:
            first_difference = index
    return {
        "rounds": len(ours),
        "reference_rounds": len(reference),
        "identical": same,
        "shrunk": shrunk,
        "first_difference": first_difference,
    }


class OpCount(TorchDispatchMode):
    """Counts the aten ops dispatched while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def ops_per_round(run, ids: list[int], budget: int, new_tokens: int) -> float:
    """The aten ops of a traced `run` of `ids` over its rounds."""
    with OpCount() as count:
        rounds = len(run(ids, budget, new_tokens, True)["rounds"])
    return round(count.ops / max(rounds, 1), 1)


@contextmanager
def clock(kind: str) -> Iterator[None]:
    """`cpu`: time.perf_counter reads this thread's CPU time while the engines run. Both read
    that clock (ours for its decode rate and stages, the reference for its round stamps), and
    with one torch thread all their work runs on this thread: on a loaded machine the figure
    is what each one's work costs, not how long it waited for a core."""
    wall = time.perf_counter
    if kind == "cpu":
        time.perf_counter = time.thread_time
    try:
        yield
    finally:
        time.perf_counter = wall


def measure(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    tokenizer = load_tokenizer(args.model)
    texts = held_out_prompts(args.prompts, args.prompt_chars)
    prompts = [tokenizer.encode(text) for text in texts]
    engines = {
        "ours": Ours(args.model, args.draft, dtype),
        "reference": Reference(args.reference, args.model, args.draft, dtype),
    }
    with clock(args.clock):
        return compare(args, engines, prompts)


def compare(args: argparse.Namespace, engines: dict, prompts: list[list[int]]) -> dict:
    """The traced runs' trees, then the interleaved timed repeats (see the module docstring)."""
    run = {name: engine.run for name, engine in engines.items()}
    for name in engines:  # warm-up
        run[name](prompts[0], args.budget, 16)

    trees, outputs_equal = [], True
    for ids in prompts:
        mine, theirs = (run[name](ids, args.budget, args.max_new_tokens, True) for name in engines)
        outputs_equal &= mine["output"] == theirs["output"][: args.max_new_tokens]
        depth = engines["ours"].drafter.block_size - 1
        trees.append(compare_trees(mine["rounds"], theirs["rounds"], depth, args.max_new_tokens))

    ops = {
        name: ops_per_round(run[name], prompts[0], args.budget, args.max_new_tokens)
        for name in engines
    }

    rates: dict[str, list[float]] = {"ours": [], "reference": [], "reference_own": []}
    ratios, stages = [], {name: [] for name in engines}
    for repeat in range(args.repeats):
        for index, ids in enumerate(prompts):
            order = list(engines) if (repeat + index) % 2 == 0 else list(engines)[::-1]
            got = {name: run[name](ids, args.budget, args.max_new_tokens) for name in order}
            rates["ours"].append(got["ours"]["tok_s"])
            rates["reference"].append(got["reference"]["tok_s"])
            rates["reference_own"].append(got["reference"]["own_tok_s"])
            ratios.append(got["ours"]["tok_s"] / got["reference"]["tok_s"])
            for name in engines:
                stages[name].append(got[name]["stage_ms_per_token"])
            print(
                f"repeat {repeat} prompt {index}: ours {got['ours']['tok_s']:.1f} tok/s, "
                f"reference {got['reference']['tok_s']:.1f} ({ratios[-1]:.3f}x)",
                file=sys.stderr,
                flush=True,
            )
    spreads = {name: median_interval(values) for name, values in rates.items()}
    ratio = median_interval(ratios)
    return {
        "ratio": ratio.to_json(),
        "ratio_text": f"{ratio.text('x', digits=3)} {interval_name(ratio.n)}",
        "tok_s": {name: spread.to_json() for name, spread in spreads.items()},
        "stage_ms_per_token": {name: median_stages(runs) for name, runs in stages.items()},
        "outputs_equal": outputs_equal,
        "trees": trees,
        "ops_per_round": ops,
        "settings": {
            "prompt_tokens": [len(ids) for ids in prompts],
            "max_new_tokens": args.max_new_tokens,
            "budget": args.budget,
            "repeats": args.repeats,
            "dtype": args.dtype,
            "threads": args.threads,
            "clock": args.clock,
        },
    }


def median_stages(runs: list[dict[str, float]]) -> dict[str, float]:
    """Each stage's median over runs (ms per token; each engine names its own stages)."""
    return {name: round(statistics.median(run[name] for run in runs), 3) for name in runs[0]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reference", required=True, type=Path, help="liranringel/ddtree checkout")
    parser.add_argument("--model", required=True, type=Path, help="dense Qwen3 target directory")
    parser.add_argument("--draft", required=True, type=Path, help="DFlash drafter directory")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-chars", type=int, default=400, help="characters per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--budget", type=int, default=15)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="cpu: both engines timed by this thread's CPU time (a loaded machine)",
    )
    parser.add_argument("--json", type=Path, help="also write the report here")
    args = parser.parse_args(argv)
    if not (args.reference / "ddtree.py").is_file():
        print(
            f"Error: {args.reference}: no ddtree.py (a liranringel/ddtree checkout)",
            file=sys.stderr,
        )
        return 2
    for name in ("prompts", "prompt_chars", "max_new_tokens", "budget", "repeats", "threads"):
        if getattr(args, name) < 1:
            print(f"Error: --{name.replace('_', '-')} must be at least 1", file=sys.stderr)
            return 2
    if args.clock == "cpu" and args.threads != 1:
        print(
            "Error: --clock cpu needs --threads 1 (it reads one thread's CPU time)", file=sys.stderr
        )
        return 2
    started = time.monotonic()
    report = measure(args)
    report["seconds"] = round(time.monotonic() - started, 1)
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
