"""Time to first token per turn of a multi-turn conversation, prefix cache off and on, in one process.

    python -m engine.tools.prefix_cache_turns --model DIR [--draft DIR] [--methods ar,ddtree] \\
        [--history 3500] [--max-new-tokens 32] [--prefill-chunk 2048] [--dtype float32] \\
        [--repeats 1] [--json FILE]

With a chat template (the demo pair): an agent's conversation rendered by the model's template, a
system prompt and tools, then turns that alternate a user request and a tool result (held-out
standard-library source, engine/data/corpus.py), each answer fed back as the assistant's
message, until a user turn's prompt reaches --history tokens. Without one (a random checkpoint, such as
tests/helpers/qwen36_checkpoint.py's): token ids, a first prompt of --history tokens, then
--turns turns of the answer and --turn-tokens new ones.

Each turn runs twice on one server's pool (engine/cache_pool.py): with `cache_prompt` off, then
on, so both see the same machine; their outputs must be identical (exit 1 otherwise). The chat
prompt's checkpoint where its messages end is the server's (engine/server/chat_completions.py).
Prints a line per turn (prompt tokens, cached tokens, TTFT off and on, their ratio), then with
--repeats N (N conversations per method, each in a fresh pool) the per-turn medians, and with
--json writes those. Not the runtime: a measurement (engine/NOTES.md).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from engine.methods import METHODS

SYSTEM = "You are a coding agent. Read files with read_file; answer briefly."
READ_FILE = {
    "type": "function",
    "function": {
        "name": "read_file",
        "description": "The contents of a file",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
    },
}
TOOL_RESULT_CHARS = 2800  # ~950 demo tokens: the last short turn follows ~3.5k of history


@dataclass
class Turn:
    method: str
    turn: int
    prompt_tokens: int
    cached_tokens: int
    ttft_off_s: float
    ttft_on_s: float
    same_output: bool

    @property
    def ratio(self) -> float:
        return self.ttft_on_s / self.ttft_off_s if self.ttft_off_s else 0.0


def chat_turns(tokenizer, history: int) -> Iterator[tuple[list[int], tuple[int, ...]]]:
    """(prompt ids, checkpoints) per turn of an agent conversation; `send` the answer's text back."""
    from engine.data.corpus import read_texts, stdlib_files
    from engine.prefix_cache import messages_end

    sources = [text[:TOOL_RESULT_CHARS] for text in read_texts(stdlib_files()[1])]
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Tidy tree.py."}]
    tools, turn = [READ_FILE], 0
    while True:
        text = tokenizer.render_chat(messages, True, tools=tools)
        ids = tokenizer.encode(text)
        history = tokenizer.render_chat(messages, False, tools=tools)
        answer = yield ids, (messages_end(ids, text, history, tokenizer.encode),)
        if len(ids) >= history and messages[-1]["role"] == "user":  # ends on a short turn
            return
        messages.append({"role": "assistant", "content": answer})
        if turn % 2 == 0:
            call = {"id": f"call_{turn}", "type": "function"}
            call["function"] = {"name": "read_file", "arguments": json.dumps({"path": "x.py"})}
            messages[-1]["tool_calls"] = [call]
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": sources[turn]})
        else:
            messages.append({"role": "user", "content": f"Now the next file, please ({turn})."})
        turn += 1


def token_turns(vocab: int, history: int, turns: int, new: int):
    """Random token ids: a prompt of `history`, then `turns` turns of the answer and `new` more."""
    rng = random.Random(0)
    ids = [rng.randrange(vocab) for _ in range(history)]
    for _ in range(turns + 1):
        answer = yield list(ids), ()
        ids += answer + [rng.randrange(vocab) for _ in range(new)]


def run(args: argparse.Namespace) -> list[Turn]:
    """Every method's conversation, --repeats times (each in a fresh pool): per turn the
    median TTFTs, and whether every run's outputs matched."""
    import torch

    from engine.models import load_drafter, load_target

    dtype = getattr(torch, args.dtype)
    target = load_target(args.model, dtype=dtype, device=args.device)
    drafter = load_drafter(args.draft, dtype=dtype, device=args.device) if args.draft else None
    tokenizer = _tokenizer(args.model)
    results = []
    for method in args.methods:
        runs = [conversation(args, target, drafter, tokenizer, method) for _ in range(args.repeats)]
        for turns in zip(*runs, strict=True):
            median = replace(
                turns[0],
                ttft_off_s=statistics.median(t.ttft_off_s for t in turns),
                ttft_on_s=statistics.median(t.ttft_on_s for t in turns),
                same_output=all(t.same_output for t in turns),
            )
            results.append(median)
            print("median " + _line(median), flush=True)
    return results


def conversation(args, target, drafter, tokenizer, method: str) -> list[Turn]:
    """One conversation in a fresh server pool: each turn cache off, then on."""
    from engine.cache_pool import CachePool
    from engine.decode import GenerationConfig, generate

    pool = CachePool.for_server(
        target, drafter if method != "ar" else None, args.max_len, args.cache_bytes
    )
    cfg = GenerationConfig(
        method=method,
        budget=args.budget,
        max_new_tokens=args.max_new_tokens,
        prefill_chunk=args.prefill_chunk,
        stop_token_ids=tuple(tokenizer.eos_token_ids) if tokenizer else (),
    )
    generate(target, drafter, [1, 2, 3], replace(cfg, cache_prompt=False), pool=pool)  # warm
    if tokenizer is not None:
        turns = chat_turns(tokenizer, args.history)
    else:
        turns = token_turns(target.config.vocab_size, args.history, args.turns, args.turn_tokens)
    prompt, checkpoints = next(turns)
    results = []
    while True:
        marked = replace(cfg, checkpoints=checkpoints)
        off = generate(target, drafter, prompt, replace(marked, cache_prompt=False), pool=pool)
        on = generate(target, drafter, prompt, marked, pool=pool)
        same = on.output_ids == off.output_ids
        turn = Turn(
            method, len(results) + 1, len(prompt), on.cached_tokens, off.ttft_s, on.ttft_s, same
        )
        results.append(turn)
        print(_line(turn), flush=True)
        answer = on.output_ids[:-1] if on.finish_reason == "stop" else on.output_ids
        try:
            prompt, checkpoints = turns.send(tokenizer.decode(answer) if tokenizer else answer)
        except StopIteration:
            return results


def _tokenizer(model_dir: Path):
    from engine.tokenizer import load_tokenizer

    if not (model_dir / "tokenizer.json").exists():
        return None
    tokenizer = load_tokenizer(model_dir)
    return tokenizer if tokenizer.chat_template else None


def _line(turn: Turn) -> str:
    return (
        f"{turn.method:7s} turn {turn.turn:2d}  prompt {turn.prompt_tokens:6d}  cached "
        f"{turn.cached_tokens:6d}  TTFT off {turn.ttft_off_s * 1e3:8.1f} ms  on "
        f"{turn.ttft_on_s * 1e3:8.1f} ms  on/off {turn.ratio:5.2f}"
        + ("" if turn.same_output else "  OUTPUTS DIFFER")
    )


def main(argv: list[str] | None = None) -> int:
    from engine.memory_plan import parse_size

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, type=Path)
    parser.add_argument("--draft", type=Path)
    parser.add_argument("--methods", default="ar,ddtree")
    parser.add_argument("--budget", type=int, default=15)
    parser.add_argument("--history", type=int, default=3500, help="tokens of history to reach")
    parser.add_argument("--turns", type=int, default=2, help="turns after the first (no template)")
    parser.add_argument("--turn-tokens", type=int, default=200, help="new tokens a turn adds")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=1, help="conversations per method")
    parser.add_argument("--prefill-chunk", type=int, default=2048)
    parser.add_argument("--max-len", type=int, default=4096, help="the pool's context")
    parser.add_argument("--prefix-cache-memory", default="2GiB")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float64"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", type=Path, help="write the turns here")
    args = parser.parse_args(argv)
    args.methods = args.methods.split(",")
    try:
        args.cache_bytes = parse_size(args.prefix_cache_memory)
    except ValueError as error:
        print(f"Error: {error}", file=sys.stderr)
        return 2
    if not set(args.methods) <= set(METHODS) or (args.methods != ["ar"] and not args.draft):
        print(f"Error: --methods from {METHODS}; linear and ddtree need --draft", file=sys.stderr)
        return 2
    started = time.perf_counter()
    turns = run(args)
    if args.json:
        rows = [{**vars(t), "ratio": t.ratio} for t in turns]
        args.json.write_text(json.dumps({"turns": rows, "wall_s": time.perf_counter() - started}))
    return 0 if all(t.same_output for t in turns) else 1


if __name__ == "__main__":
    sys.exit(main())
