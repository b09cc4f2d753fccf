"""Measure engine/parallel.py's design choices on this machine (CPU/gloo or CUDA/NCCL).

    python -m engine.tools.parallel_measure --model DIR --draft DIR [--tp 2] [--rounds 20] [--device cpu]

Prints one JSON document of seconds (medians over `rounds`):
- `verify`: one 16-token verify round (forward + commit of one token) of the whole model on one
  rank, and over `tp` ranks with the lm_head replicated (rank 0 alone computes the logits) or
  vocab-sharded (every rank its rows, gathered to rank 0);
- `command_broadcast`: one 16-token forward command sent from rank 0 (the control cost each
  forward / commit pays);
- `draft_rank0_only` / `draft_every_rank`: one drafter call on rank 0 while the other ranks wait
  (the engine's design) or while every rank runs its own copy at the same moment (the
  alternative).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.models import load_drafter, load_target
from engine.parallel import (
    LEADER,
    LM_HEAD_MODES,
    Command,
    broadcast_command,
    init_group,
    launch_target,
    rank_device,
)

VERIFY_TOKENS = 16
PROMPT_TOKENS = 32


def median_seconds(step: Callable[[], object], rounds: int, device: str) -> float:
    """Median wall time of `step` (one warm-up call first)."""
    step()
    times = []
    for _ in range(rounds):
        _sync(device)
        start = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def verify_round_seconds(target, rounds: int, device: str) -> float:
    """A prefill, then 16-token verify rounds that each commit one token."""
    vocab = target.config.vocab_size
    cache = target.new_cache(PROMPT_TOKENS + rounds + 1 + VERIFY_TOKENS)
    prompt = torch.randint(0, vocab, (PROMPT_TOKENS,), device=device)
    target.forward(prompt, cache)
    target.commit(cache, torch.arange(PROMPT_TOKENS, device=device))
    ids = torch.randint(0, vocab, (VERIFY_TOKENS,), device=device)
    root = torch.zeros(1, dtype=torch.long, device=device)

    def step() -> None:
        target.forward(ids, cache)
        target.commit(cache, root)

    return median_seconds(step, rounds, device)


def measure_verify(model_dir: Path, tp: int, rounds: int, device: str) -> dict[str, float]:
    figures = {"tp1": verify_round_seconds(load_target(model_dir, device=device), rounds, device)}
    for mode in LM_HEAD_MODES:
        target = launch_target(model_dir, torch.float32, device, tp, lm_head=mode)
        figures[f"tp{tp}_lm_head_{mode}"] = verify_round_seconds(target, rounds, device)
        target.close()
    return figures


def measure_rank_group(model_dir: Path, draft_dir: Path, tp: int, rounds: int, device: str):
    """Seconds per draft on rank 0 (others idle vs every rank drafting), per command broadcast."""
    figures = {}
    context = mp.get_context("spawn")
    for every_rank in (False, True):
        results = context.SimpleQueue()
        with tempfile.TemporaryDirectory(prefix="ddops-tp-") as rendezvous:
            init_method = "file://" + os.path.join(rendezvous, "store")
            args = (tp, init_method, str(model_dir), str(draft_dir), rounds, device, every_rank)
            processes = [
                context.Process(target=_draft_rank, args=(rank, *args, results))
                for rank in range(tp)
            ]
            for process in processes:
                process.start()
            for process in processes:
                process.join()
        draft, command = results.get()
        figures["draft_every_rank" if every_rank else "draft_rank0_only"] = draft
        figures["command_broadcast"] = command
    return figures


def _draft_rank(rank, world, init_method, model_dir, draft_dir, rounds, device, every, results):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    local = rank_device(device, rank)
    init_group(rank, world, local, init_method)
    target = load_target(model_dir, device=local)
    drafter = load_drafter(draft_dir, device=local)
    context_width = len(drafter.target_layer_ids) * target.config.hidden_size
    context = torch.randn(PROMPT_TOKENS, context_width, device=local)

    def step() -> None:
        dist.barrier()
        if every or rank == LEADER:
            cache = drafter.new_cache(PROMPT_TOKENS + drafter.block_size)
            drafter.draft(target, cache, context, 1)
            _sync(local)
        dist.barrier()

    forward = Command("forward", ids=list(range(VERIFY_TOKENS)), parents=[-1] * VERIFY_TOKENS)

    def send() -> None:
        broadcast_command(forward if rank == LEADER else None)

    figures = median_seconds(step, rounds, local), median_seconds(send, rounds, local)
    if rank == LEADER:
        results.put(figures)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m engine.tools.parallel_measure")
    parser.add_argument("--model", required=True, type=Path)
    parser.add_argument("--draft", required=True, type=Path)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.tp))
    with torch.inference_mode():
        verify = measure_verify(args.model, args.tp, args.rounds, args.device)
    group = measure_rank_group(args.model, args.draft, args.tp, args.rounds, args.device)
    threads = torch.get_num_threads()
    print(json.dumps({"tp": args.tp, "threads_per_rank": threads, "verify": verify, **group}))


if __name__ == "__main__":
    main()
