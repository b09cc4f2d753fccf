"""`python -m engine generate`: one generation with ar, linear (DFlash chain) or ddtree decoding.

    python -m engine generate --model DIR --draft DRAFT_DIR --method ddtree --budget 15 \
        --prompt "w1 w2" --max-new-tokens 64 --json [--trace] [--tp 2] [--prefill-chunk 2048]

Prints the text (or, with --json, one JSON document: output_ids, text, acceptance_lengths,
decode_tokens_per_s, stage_seconds, finish_reason, ttft_s, and rounds with --trace).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from engine.methods import METHODS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", required=True, type=Path, help="target model directory (HF format)"
    )
    parser.add_argument("--draft", type=Path, help="DFlash drafter directory (linear, ddtree)")
    parser.add_argument("--method", choices=METHODS, default="ddtree")
    parser.add_argument("--budget", type=int, default=15, help="ddtree node budget")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument(
        "--prompt", help="prompt text, encoded with the model directory's tokenizer"
    )
    prompt.add_argument("--prompt-ids", help="comma-separated prompt token ids")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float64"))
    parser.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    parser.add_argument(
        "--tp", type=int, default=1, help="tensor-parallel ranks (spawned, or torchrun's)"
    )
    parser.add_argument(
        "--prefill-chunk",
        type=int,
        default=2048,
        help="prompt tokens per prefill pass (bounds a long prompt's memory; default 2048)",
    )
    parser.add_argument(
        "--no-cuda-graphs",
        dest="cuda_graphs",
        action="store_false",
        help="run every pass eagerly on CUDA (by default the static passes are replayed as CUDA graphs)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    parser.add_argument(
        "--trace", action="store_true", help="add the per-round trees (with --json)"
    )


def run(args: argparse.Namespace) -> int:
    import torch

    from engine.decode import GenerationConfig, generate
    from engine.models import load_drafter
    from engine.models.common import default_device, resolve_dtype
    from engine.parallel import close_target, open_target

    if args.method != "ar" and args.draft is None:
        print(f"Error: --method {args.method} needs --draft DIR", file=sys.stderr)
        return 2
    if args.tp < 1:
        print(f"Error: --tp must be at least 1, not {args.tp}", file=sys.stderr)
        return 2
    if args.prefill_chunk < 1:
        print(
            f"Error: --prefill-chunk must be at least 1, not {args.prefill_chunk}", file=sys.stderr
        )
        return 2
    tokenizer = _tokenizer_or_none(args.model)
    if args.prompt is not None and tokenizer is None:
        print(f"Error: {args.model}: no tokenizer.json for --prompt", file=sys.stderr)
        return 2
    device = args.device or default_device()
    dtype = resolve_dtype(args.dtype, device)
    prompt_ids = (
        tokenizer.encode(args.prompt)
        if args.prompt is not None
        else [int(i) for i in args.prompt_ids.split(",") if i.strip()]
    )
    target = open_target(args.model, dtype, device, args.tp)
    if target is None:  # a torchrun follower: rank 0 has finished
        return 0
    drafter = load_drafter(args.draft, dtype, device) if args.method != "ar" else None
    cfg = GenerationConfig(
        method=args.method,
        budget=args.budget,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        seed=args.seed,
        stop_token_ids=tokenizer.eos_token_ids if tokenizer else (),
        trace=args.trace,
        prefill_chunk=args.prefill_chunk,
        cuda_graphs=args.cuda_graphs,
    )
    with torch.inference_mode():
        result = generate(target, drafter, prompt_ids, cfg)
    close_target(target)
    text = tokenizer.decode(result.output_ids) if tokenizer else None
    if not args.json:
        print(text if text is not None else " ".join(map(str, result.output_ids)))
        return 0
    document = {
        "output_ids": result.output_ids,
        "text": text,
        "acceptance_lengths": result.acceptance_lengths,
        "decode_tokens_per_s": result.decode_tokens_per_s,
        "stage_seconds": result.stage_seconds,
        "finish_reason": result.finish_reason,
        "ttft_s": result.ttft_s,
    }
    if args.trace:
        document["rounds"] = result.rounds
    print(json.dumps(document))
    return 0


def _tokenizer_or_none(model_dir: Path):
    from engine.tokenizer import load_tokenizer

    return load_tokenizer(model_dir) if (model_dir / "tokenizer.json").exists() else None
