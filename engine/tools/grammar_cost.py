"""What constrained decoding costs: the grammar masks on the CPU, and ddtree's speed under them.

    python -m engine.tools.grammar_cost masks --tokenizer DIR [--vocab 248320] [--budget 15]
    python -m engine.tools.grammar_cost speed [--model DIR --draft DIR] [--runs 5]

`masks`: over the tokenizer in DIR (tokenizer.json; Qwen3.6's vocabulary at real size), a JSON
answer is walked token by token; at each position a round's masks are computed as a ddtree
round needs them (the root and `budget` nodes: here the next `budget` tokens as a chain, each
its own matcher state, all masks in one parallel call), then applied to float32 logits
[budget + 1, vocab] on the CPU. Prints one JSON document: the bytes of a mask and of a round's
masks (what reaches the device), and medians of seconds per mask (one state at a time), per
round's masks (parallel) and per round's mask application.

`speed`: the demo pair (or the given one) decodes the same chat prompts with ddtree, greedy,
free and under a JSON schema; prints tokens per second of each (median over `runs`) and the
schema's mean acceptance length. Both run on whatever else the machine is doing: say so.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from engine.grammar import Constraint, Guide, mask_logits, tokenizer_from_json

DEMO = Path(__file__).resolve().parents[1] / "demo_model"
ANSWER = {
    "name": "Ada Lovelace",
    "born": 1815,
    "fields": ["mathematics", "computing", "poetical science"],
    "address": {"city": "London", "street": "St James's Square"},
    "notes": "Wrote the first published algorithm for the Analytical Engine.",
}
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "born": {"type": "integer"},
        "fields": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "street": {"type": "string"}},
            "required": ["city", "street"],
        },
        "notes": {"type": "string"},
    },
    "required": ["name", "born", "fields", "address", "notes"],
    "additionalProperties": False,
}


def measure_masks(tokenizer_dir: Path, vocab: int | None, budget: int) -> dict:
    from tokenizers import Tokenizer

    text_tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    vocab = vocab or text_tokenizer.get_vocab_size()
    started = time.perf_counter()
    grammar_tokenizer = tokenizer_from_json(text_tokenizer.to_str(), vocab, [0])
    tokenizer_s = time.perf_counter() - started
    started = time.perf_counter()
    constraint = Constraint.from_json_schema(grammar_tokenizer, SCHEMA)
    compile_s = time.perf_counter() - started
    answer = json.dumps(ANSWER, separators=(",", ":"))
    ids = text_tokenizer.encode(answer, add_special_tokens=False).ids
    single, rounds, applied = [], [], []
    guide = Guide(constraint)
    logits = torch.randn(budget + 1, vocab)
    for position in range(len(ids)):
        started = time.perf_counter()
        guide.masks(1)
        single.append(time.perf_counter() - started)
        guide.start_round()
        chain = ids[position + 1 : position + 1 + budget]
        nodes = guide.valid_prefix(chain)
        started = time.perf_counter()
        masks = guide.masks(nodes + 1)
        rounds.append((time.perf_counter() - started, nodes + 1))
        started = time.perf_counter()
        mask_logits(logits[: nodes + 1], torch.from_numpy(masks))
        applied.append(time.perf_counter() - started)
        guide.advance([0], ids[position])
    full = [seconds for seconds, count in rounds if count == budget + 1]
    return {
        "vocab": vocab,
        "answer_tokens": len(ids),
        "tokenizer_build_s": round(tokenizer_s, 3),
        "schema_compile_s": round(compile_s, 4),
        "mask_bytes": constraint.words * 4,
        "round_mask_bytes": (budget + 1) * constraint.words * 4,
        "mask_s_median": statistics.median(single),
        "mask_s_p90": float(np.percentile(single, 90)),
        "mask_s_mean": statistics.fmean(single),
        "round_masks_s_median": statistics.median(full) if full else None,
        "round_masks_positions": budget + 1,
        "round_apply_s_median": statistics.median(applied),
    }


def measure_speed(model: Path, draft: Path, runs: int, budget: int) -> dict:
    from engine.decode import GenerationConfig, generate
    from engine.models import load_drafter, load_target
    from engine.tokenizer import load_tokenizer

    torch.set_num_threads(1)
    target, drafter, tokenizer = load_target(model), load_drafter(draft), load_tokenizer(model)
    stops = tokenizer.eos_token_ids
    vocab = target.lm_head.weight.shape[0]
    constraint = Constraint.from_json_schema(
        tokenizer_from_json(tokenizer.to_json(), vocab, stops), SCHEMA
    )
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], enable_thinking=False)
        for q in ("Who was Ada Lovelace? Answer as JSON.", "Describe a scientist as JSON.")
    ]
    configs = {
        name: GenerationConfig(
            "ddtree", budget, max_new_tokens=128, stop_token_ids=stops, constraint=grammar
        )
        for name, grammar in (("free", None), ("json_schema", constraint))
    }
    samples: dict[str, list] = {name: [] for name in configs}
    for _ in range(runs):  # interleaved: a drifting machine load hits both alike
        for prompt in prompts:
            for name, cfg in configs.items():
                samples[name].append(generate(target, drafter, prompt, cfg))
    return {name: _speed_figures(results) for name, results in samples.items()}


def _speed_figures(results: list) -> dict:
    speeds = [r.decode_tokens_per_s for r in results]
    rounds = sum(len(r.acceptance_lengths) for r in results)
    per_round = {
        stage: sum(r.stage_seconds[stage] for r in results) / rounds * 1e3
        for stage in ("draft", "tree", "verify", "commit")
    }
    return {
        "tokens_per_s_median": statistics.median(speeds),
        "tokens_per_s_spread": [min(speeds), max(speeds)],
        "mean_acceptance_length": sum(sum(r.acceptance_lengths) for r in results) / rounds,
        "ms_per_round": {stage: round(ms, 2) for stage, ms in per_round.items()},
        "output_tokens": sum(len(r.output_ids) for r in results),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    masks = commands.add_parser("masks")
    masks.add_argument("--tokenizer", type=Path, required=True)
    masks.add_argument("--vocab", type=int, default=None)
    masks.add_argument("--budget", type=int, default=15)
    speed = commands.add_parser("speed")
    speed.add_argument("--model", type=Path, default=DEMO / "target")
    speed.add_argument("--draft", type=Path, default=DEMO / "draft")
    speed.add_argument("--runs", type=int, default=5)
    speed.add_argument("--budget", type=int, default=15)
    args = parser.parse_args(argv)
    if args.command == "masks":
        print(json.dumps(measure_masks(args.tokenizer, args.vocab, args.budget), indent=2))
    else:
        print(json.dumps(measure_speed(args.model, args.draft, args.runs, args.budget), indent=2))


if __name__ == "__main__":
    main()
