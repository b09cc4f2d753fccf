"""`python -m engine serve`: the OpenAI-compatible HTTP server over one model pair.

    python -m engine serve --model DIR [--draft DIR] [--host 127.0.0.1] [--port 8000] \\
        [--max-model-len N] [--api-key KEY | env DDOPS_API_KEY] [--dtype float32] [--device cpu] \\
        [--tp N] [--prefill-chunk 2048] [--max-num-seqs N] [--max-num-batched-tokens 2048] \\
        [--kv-cache-tokens N] \\
        [--enable-prefix-caching | --no-enable-prefix-caching] [--prefix-cache-memory SIZE] \\
        [--method ar|linear|ddtree|auto] [--budget 15] [--max-waiting 32] [--served-model-name NAME] \\
        [--tool-call-parser auto|none|hermes|qwen3_coder] [--reasoning-parser auto|none|qwen3] \\
        [--max-request-bytes 8388608] [--shutdown-grace-s 5]

Before anything loads, the memory plan (engine/memory_plan.py) is held against the device's free
memory, read at start: on CUDA what `torch.cuda.mem_get_info` reports free on the (rank 0)
device; on the CPU the RAM the kernel reports available (MemAvailable), since the process has
no other bound there. A --max-model-len that cannot fit refuses to start (one line, exit 2);
without it the server serves the longest context that fits, or the model's own
max_position_embeddings when that is smaller, and reports it on /v1/models and /ready. The
prefix cache (on by default) gets --prefix-cache-memory, else what the served context leaves;
the plan's lines are logged at start.

Up to --max-num-seqs requests decode at once (engine/scheduler.py), each pass of the target at
most --max-num-batched-tokens tokens (decode rounds first, then prefill pieces: a smaller value
lets a short request's first token through sooner while a long prompt prefills). Each running
sequence holds caches for the whole served context, so the plan counts them, and the server's
cache pool is made for the plan's context, sequences and prefix-cache budget: with
--max-num-seqs that many (the context, unless given, is the longest they leave); without it as
many as fit at the served context, up to DEFAULT_MAX_NUM_SEQS. More than fit at --max-model-len
refuse to start (one line: how many do); the start-up log says how many of the served context
fit, and when neither flag was given and the model's full context leaves one slot (Qwen3.6-27B's
262,144 tokens on a 96 GB card), what to pass for more. --kv-cache-tokens N gives the sequences
one KV block pool of N tokens instead (whole 256-token blocks, beside the prefix cache's): more
sequences than fit at the whole context share it, and when it runs short the scheduler preempts
the most recently admitted one, which re-prefills later where it stopped (counted in /metrics).
Under tensor parallelism requests run one at a time (logged).

The model loads after the port opens: `/health` answers at once, `/ready` once the model is
loaded and a 1-token generation succeeded. A load failure stops the server with exit code 1.
SIGTERM (or Ctrl-C) lets requests in flight finish for --shutdown-grace-s seconds, then answers
what is left 503 "server shutting down" (engine/server/shutdown.py). An empty API key is refused.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from engine.cli.plan import add_batching_arguments, add_prefix_cache_arguments, prefix_cache_memory
from engine.memory_plan import (
    CONVERSATION_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    GIB,
    MAX_NUM_SEQS,
    planned_sequences,
)
from engine.methods import METHODS
from engine.scheduler import DEFAULT_MAX_NUM_BATCHED_TOKENS
from engine.server import API_KEY_ENV
from engine.server.body import DEFAULT_MAX_REQUEST_BYTES
from engine.server.reasoning import REASONING_PARSERS
from engine.server.tools import TOOL_CALL_PARSERS

GRACEFUL_SHUTDOWN_S = 5.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, type=Path, help="target model directory (HF)")
    parser.add_argument("--draft", type=Path, help="DFlash drafter directory (linear, ddtree)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--max-model-len",
        type=int,
        help="context limit: prompt + max_tokens (default: the longest that fits the device's "
        "free memory, at most the model's max_position_embeddings)",
    )
    parser.add_argument(
        "--prefill-chunk", type=int, default=2048, help="prompt tokens per prefill pass"
    )
    add_prefix_cache_arguments(parser)
    add_batching_arguments(parser)
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=DEFAULT_MAX_NUM_BATCHED_TOKENS,
        help="tokens of one target pass at most: decode rounds, then prefill pieces "
        f"(default: {DEFAULT_MAX_NUM_BATCHED_TOKENS})",
    )
    parser.add_argument(
        "--api-key", help=f"require 'Authorization: Bearer KEY' (default: env {API_KEY_ENV})"
    )
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float64"])
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument(
        "--no-cuda-graphs",
        dest="cuda_graphs",
        action="store_false",
        help="run every pass eagerly on CUDA (by default the static passes are replayed as CUDA graphs)",
    )
    parser.add_argument(
        "--tp", type=int, default=1, help="tensor-parallel ranks (this process spawns them)"
    )
    parser.add_argument(
        "--method",
        choices=METHODS,
        help="default decoding method (default: auto with --draft, else ar)",
    )
    parser.add_argument(
        "--budget", type=int, default=15, help="default ddtree node budget (auto's cap)"
    )
    parser.add_argument(
        "--max-waiting", type=int, default=32, help="requests that may wait (then 503)"
    )
    parser.add_argument("--served-model-name", help="model id in the API (default: --model's name)")
    parser.add_argument(
        "--tool-call-parser",
        default="auto",
        choices=TOOL_CALL_PARSERS,
        help="tool-call format of the model's output (default: the one its chat template teaches)",
    )
    parser.add_argument(
        "--reasoning-parser",
        default="auto",
        choices=REASONING_PARSERS,
        help="<think> reasoning into reasoning_content (default: if the chat template thinks)",
    )
    parser.add_argument(
        "--max-request-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help="largest request body; a larger one is a 413 (default: 8 MiB)",
    )
    parser.add_argument(
        "--shutdown-grace-s",
        type=float,
        default=GRACEFUL_SHUTDOWN_S,
        help="at SIGTERM, seconds requests in flight may finish in before a 503 (default: 5)",
    )
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning"])


def _api_key(args: argparse.Namespace) -> str | None:
    """--api-key, else the environment's; None (neither given) serves without authentication."""
    return args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV)


def _usage_problem(args: argparse.Namespace, method: str) -> str | None:
    key = _api_key(args)
    if key is not None and (not key or key != key.strip()):
        what = "empty" if not key.strip() else "padded with whitespace"
        return (
            f"the API key (--api-key or {API_KEY_ENV}) is {what}; "
            f"give a real key, or unset {API_KEY_ENV} to serve without authentication"
        )
    if method != "ar" and not args.draft:
        return f"--method {method} needs --draft (a DFlash drafter directory)"
    if args.budget < 1 or args.max_waiting < 1:
        return "--budget and --max-waiting must be at least 1"
    if args.tp < 1:
        return "--tp must be at least 1"
    if args.max_model_len is not None and args.max_model_len < 2:
        return "--max-model-len must be at least 2 (a prompt token and a generated one)"
    if args.max_request_bytes < 1 or not 0 <= args.shutdown_grace_s <= 3600:
        return "--max-request-bytes must be at least 1, --shutdown-grace-s within 0..3600"
    if args.prefill_chunk < 1:
        return "--prefill-chunk must be at least 1"
    if args.max_num_seqs is not None and not 1 <= args.max_num_seqs <= MAX_NUM_SEQS:
        return f"--max-num-seqs must be from 1 to {MAX_NUM_SEQS}"
    if args.max_num_batched_tokens < 1:
        return "--max-num-batched-tokens must be at least 1"
    if args.kv_cache_tokens is not None and args.kv_cache_tokens < 1:
        return "--kv-cache-tokens must be at least 1"
    try:
        prefix_cache_memory(args)
    except ValueError as error:
        return f"--prefix-cache-memory: {error}"
    return None


def available_memory(device: str) -> int:
    """Bytes the engine may use on `device`: free CUDA memory, or the CPU's MemAvailable."""
    if device.startswith("cuda"):
        import torch

        free, _total = torch.cuda.mem_get_info(torch.device(device))
        return free
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise OSError("/proc/meminfo has no MemAvailable")


def memory_plan(args: argparse.Namespace):
    """The memory plan of this serve command on the device's free memory: --max-num-seqs
    sequences at once, else as many as fit at the served context (at least one, at most
    DEFAULT_MAX_NUM_SEQS; as many beside a --kv-cache-tokens pool, which they share; one under
    tensor parallelism, engine/server/app.py)."""
    from dataclasses import replace

    if sequences := planned_sequences(args.max_num_seqs, args.kv_cache_tokens, args.tp):
        return _plan(args, sequences)
    plan = _plan(args, 1)
    if plan.problem():
        return plan
    context = plan.served_context
    sequences = max(1, min(DEFAULT_MAX_NUM_SEQS, plan.sequences_fitting(context)))
    return replace(plan, sequences=sequences, max_model_len=context)


def _plan(args: argparse.Namespace, sequences: int):
    from engine.memory_plan import plan_from_dirs

    return plan_from_dirs(
        args.model,
        args.draft,
        args.dtype,
        available_memory(args.device),
        args.max_model_len,
        args.tp,
        args.prefill_chunk,
        args.budget + 1,
        args.enable_prefix_caching,
        prefix_cache_memory(args),
        sequences,
        args.kv_cache_tokens if args.tp == 1 else None,  # tensor parallel: one sequence's caches
    )


def context_limit(args: argparse.Namespace) -> tuple[int, str | None]:
    """(the context to serve, why it cannot be served or None), from the memory plan."""
    return served_context(memory_plan(args), args)


def served_context(plan, args: argparse.Namespace) -> tuple[int, str | None]:
    """(the context to serve, or 0 and why not): the plan's sequences at --max-model-len, or at
    the longest context they leave (at least 2 tokens: a prompt token and a generated one)."""
    if problem := plan.problem():
        return 0, f"{_culprit(plan)} does not fit: {problem}"
    limit = plan.served_context  # the context the server's cache pool is made for
    if limit >= 2:
        return limit, None
    if plan.sequences > 1 and plan.sequences_fitting(2):
        return 0, (
            f"--max-num-seqs {plan.sequences} does not fit: {plan.sequences} sequences at once "
            f"leave no context (at most {plan.sequences_fitting(2)} fit, "
            f"{plan.sequences_fitting(CONVERSATION_TOKENS)} at {CONVERSATION_TOKENS} tokens)"
        )
    return 0, (
        f"the model does not fit: it needs {plan.fixed_bytes / GIB:.2f} GiB before any "
        f"context, the device has {plan.device_memory / GIB:.2f} GiB free"
    )


def _culprit(plan) -> str:
    """The flag a plan's problem is about."""
    if not plan.pool_fits:
        return "--kv-cache-tokens"
    if plan.kv_cache_tokens is not None or not plan.sequences_fitting(plan.max_model_len):
        return "--max-model-len"
    return "--max-num-seqs"


def sequences_note(plan, args: argparse.Namespace) -> str:
    """The start-up line on the sequences at once: how many of the served context fit, and,
    when the user chose neither --max-model-len nor --max-num-seqs and the context leaves one
    slot, what to pass for more."""
    context = plan.served_context
    fitting = plan.sequences_fitting(context)
    line = f"sequences at once: {plan.sequences}, each up to {context} tokens ({fitting} fit)"
    if plan.kv_cache_tokens is not None:
        return (
            f"sequences at once: {plan.sequences}, each up to {context} tokens, sharing a KV pool "
            f"of {plan.kv_cache_tokens} tokens ({fitting} of that length at once; beyond, the "
            f"scheduler preempts)"
        )
    shorter = plan.sequences_fitting(CONVERSATION_TOKENS)
    chose = args.max_model_len is not None or args.max_num_seqs is not None
    if chose or args.tp > 1 or plan.sequences > 1 or context <= CONVERSATION_TOKENS or shorter < 2:
        return line
    return (
        f"{line}: the default context ({context} tokens) leaves room for one sequence at a time; "
        f"pass --max-model-len {CONVERSATION_TOKENS} for {shorter} at once "
        f"(or --max-num-seqs N for the longest context N fit)"
    )


def run(args: argparse.Namespace) -> int:
    method = args.method or ("auto" if args.draft else "ar")
    if problem := _usage_problem(args, method):
        print(f"Error: {problem}", file=sys.stderr)
        return 2
    try:
        plan = memory_plan(args)
        max_model_len, problem = served_context(plan, args)
    except (OSError, ValueError, KeyError) as error:
        problem = f"cannot plan memory for {args.model}: {error}"
    if problem:
        print(f"Error: {problem}", file=sys.stderr)
        return 2

    from engine.server.app import create_app, load_engine
    from engine.server.shutdown import draining_server
    from engine.server.state import ServerConfig

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    config = ServerConfig(
        model_name=args.served_model_name or args.model.resolve().name,
        default_method=method,
        default_budget=args.budget,
        api_key=_api_key(args),
        max_waiting=args.max_waiting,
        max_request_bytes=args.max_request_bytes,
        shutdown_grace_s=args.shutdown_grace_s,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
    )

    options = {"prefill_chunk": args.prefill_chunk, "cuda_graphs": args.cuda_graphs}

    def load():
        engine = load_engine(
            args.model,
            args.draft,
            args.dtype,
            args.device,
            max_model_len,
            args.tp,
            plan.prefix_cache_bytes,
            plan.sequences,
            args.max_num_batched_tokens,
            options,
            plan.kv_cache_tokens,
        )
        return with_generation_options(engine, **options)

    server = None

    def stop_server() -> None:
        server.should_exit = True

    app = create_app(load, config, on_fatal=stop_server)
    server = draining_server(app, host=args.host, port=args.port, log_level=args.log_level)
    log = logging.getLogger(__name__)
    for line in plan.lines():
        log.info("memory plan: %s", line)
    log.info("%s", sequences_note(plan, args))
    log.info("serving a context of up to %d tokens", max_model_len)
    server.run()
    return 1 if app.state.server.worker.startup_error else 0


def with_generation_options(engine, **options):
    """The loaded engine with every generation's GenerationConfig given `options` (the server's
    --prefill-chunk, --no-cuda-graphs; its scheduler was given them by load_engine)."""
    from dataclasses import replace

    generate = engine.generate

    def configured(prompt_ids, cfg, **callbacks):
        return generate(prompt_ids, replace(cfg, **options), **callbacks)

    return replace(engine, generate=configured)
