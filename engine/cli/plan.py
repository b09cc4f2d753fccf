"""`python -m engine plan`: the memory plan of a target (and drafter) on one device, no torch.

    python -m engine plan --model DIR [--draft DIR] --dtype bfloat16 --device-memory 96GiB \\
        [--max-model-len N] [--tp N] [--prefill-chunk 2048] [--budget 15] \\
        [--prefix-cache-memory SIZE | --no-enable-prefix-caching] [--max-num-seqs N] \\
        [--kv-cache-tokens N] [--json]

Prints the weights, KV bytes per token, recurrent state, the largest transient, the longest
context that fits and the prefix cache's budget beside it (engine/memory_plan.py), or with
--json one document of them. Exit 2 on bad input
or when --max-model-len cannot fit (one line saying why, with the numbers).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from engine.memory_plan import (
    DEFAULT_PREFILL_CHUNK,
    DTYPE_BYTES,
    parse_size,
    plan_from_dirs,
    planned_sequences,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, type=Path, help="target model directory")
    parser.add_argument("--draft", type=Path, help="DFlash drafter directory")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPE_BYTES))
    parser.add_argument(
        "--device-memory", required=True, help="memory of one device, e.g. 96GiB or 80GB"
    )
    parser.add_argument("--max-model-len", type=int, help="check that this context fits")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks")
    parser.add_argument("--prefill-chunk", type=int, default=DEFAULT_PREFILL_CHUNK)
    parser.add_argument("--budget", type=int, default=15, help="ddtree budget (verify = +1)")
    add_prefix_cache_arguments(parser)
    add_batching_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON document")


def add_prefix_cache_arguments(parser: argparse.ArgumentParser) -> None:
    """The prefix cache's flags, shared with `serve` (vLLM's names for on and off)."""
    parser.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the state of cached prompt prefixes across requests (default: on)",
    )
    parser.add_argument(
        "--prefix-cache-memory",
        help="the prefix cache's budget, e.g. 8GiB (default: what the served context leaves)",
    )


def add_batching_arguments(parser: argparse.ArgumentParser) -> None:
    """The sequences decoding at once and their KV pool, shared with `serve`."""
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        help="sequences decoding at once, each with caches for the whole context "
        "(plan default: 1; serve's: as many as fit, up to 4)",
    )
    parser.add_argument(
        "--kv-cache-tokens",
        type=int,
        help="the running sequences share a KV pool of this many tokens (default: "
        "--max-num-seqs whole contexts); when it runs short one is preempted and recomputed",
    )


def prefix_cache_memory(args: argparse.Namespace) -> int | None:
    """--prefix-cache-memory in bytes (None: the default); ValueError for a bad size."""
    return None if args.prefix_cache_memory is None else parse_size(args.prefix_cache_memory)


def run(args: argparse.Namespace) -> int:
    try:
        device_memory = parse_size(args.device_memory)
        plan = plan_from_dirs(
            args.model,
            args.draft,
            args.dtype,
            device_memory,
            args.max_model_len,
            args.tp,
            args.prefill_chunk,
            args.budget + 1,
            args.enable_prefix_caching,
            prefix_cache_memory(args),
            planned_sequences(args.max_num_seqs, args.kv_cache_tokens, args.tp) or 1,
            args.kv_cache_tokens,
        )
    except (OSError, ValueError, KeyError) as error:
        print(f"Error: {_reason(error)}", file=sys.stderr)
        return 2
    print(json.dumps(plan.to_dict()) if args.json else "\n".join(plan.lines()))
    if problem := plan.problem():
        print(f"Error: {problem}", file=sys.stderr)
        return 2
    return 0


def _reason(error: Exception) -> str:
    if isinstance(error, KeyError):
        return f"config.json has no {error.args[0]!r}"
    if isinstance(error, OSError):
        return f"cannot read {error.filename}: {error.strerror}"
    return str(error)
