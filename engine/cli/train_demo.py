"""`python -m engine train-demo`: train the tiny demo target and its DFlash drafter on CPU.

    python -m engine train-demo --out DIR [--reuse-target] [--mini] [--dense] [--threads 2]

Writes DIR/target (hybrid Qwen3.5-style target + tokenizer; `--dense`: a Qwen3 one, every layer
attention, for engine/tools/ddtree_reference.py), DIR/draft (DFlash drafter) and
DIR/training.json (held-out next-token accuracy, held-out linear tau, a greedy sample). The shipped
engine/demo_model/ is `--out engine/demo_model`; `--mini` is the seconds-long smoke recipe.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, type=Path, help="output directory")
    parser.add_argument(
        "--reuse-target",
        action="store_true",
        help="keep OUT/target and its tokenizer; train only the drafter",
    )
    parser.add_argument("--mini", action="store_true", help="tiny sizes and steps (a smoke run)")
    parser.add_argument(
        "--dense", action="store_true", help="a dense Qwen3 target (every layer attention)"
    )
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")


def run(args: argparse.Namespace) -> int:
    import torch

    from engine.tools.train_demo import MINI, Recipe, train_demo

    torch.set_num_threads(args.threads)
    start = time.monotonic()

    def log(message: str) -> None:
        print(f"[{time.monotonic() - start:7.1f}s] {message}", flush=True)

    if args.reuse_target and (error := _reuse_error(args.out / "target", args.dense)):
        print(f"Error: --reuse-target: {error}", file=sys.stderr)
        return 2
    recipe = replace(MINI if args.mini else Recipe(), dense=args.dense)
    train_demo(args.out, recipe, log, reuse_target=args.reuse_target)
    log(f"wrote {args.out / 'target'}, {args.out / 'draft'}, {args.out / 'training.json'}")
    return 0


def _reuse_error(target: Path, dense: bool) -> str | None:
    """Why `target` cannot be reused by a run with(out) --dense: none there, or the other kind
    (its drafter would read the features another pair's does)."""
    config = target / "config.json"
    if not config.exists():
        return f"{target} holds no trained target"
    try:
        model_type = json.loads(config.read_text()).get("model_type")
    except (OSError, ValueError, AttributeError) as error:
        return f"{config}: not a readable config ({error})"
    if (model_type == "qwen3") != dense:
        kind = "a dense" if model_type == "qwen3" else "a hybrid"
        return f"{target} holds {kind} target ({model_type}): {'drop' if dense else 'add'} --dense"
    return None
