"""The one generation path every API shares: a request's job on the worker and its events.

`submit` validates a request against the loaded engine (model name, context limit, speculative
method), builds its `GenerationConfig`, queues its `Job`s on the worker and returns the
`Generation`s the handler reads: its events (`Delta` text, then `Done` or `Failed`) arrive on an
asyncio queue, filled from the worker thread. A request's `sequences()` (`n`, completions'
`best_of`) are one job and one `Generation` each over the same prompt, sequence i of a seeded
request seeded with `sequence_seed(seed, i)` (the request's own seed for the first). With a
prefix cache the others are the first's followers: queued when it ends, they find the prompt
cached (prefilled once) and decode together; without one they are all queued at once.

`collect` gathers a whole generation (a client that hangs up cancels it), `collect_all` each of
a request's; a streaming handler iterates `events` (`merged_events` for several) and sets
`job.cancel` when it ends. `usage`, `speculative_stats` and `finish_reason` are what every API
reports of a finished job.

The body is any request of the API modules with `model`, `temperature`, `seed`, `speculative`,
`cache_prompt`, `stop_strings()`, `requested_max_tokens()`, `include_usage_chunk()`,
`sequences()`, `output_logprobs()` and `prompt_logprobs()`. Usage
reports the prompt tokens the prefix cache held as `prompt_tokens_details.cached_tokens`
(OpenAI's field), and the prefix-cache counters count what each request asked of it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import statistics
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from engine.decode import GenerationConfig
from engine.grammar import Constraint
from engine.methods import TREE_METHODS
from engine.sampling import Sampling
from engine.server.handoff import thread_safe_put
from engine.server.schemas import ApiError
from engine.server.state import LoadedEngine, ServerState
from engine.server.text import TextAssembler
from engine.server.worker import (
    SHUTTING_DOWN,
    Delta,
    Done,
    Failed,
    Job,
    QueueFull,
    ShuttingDown,
)

NO_CACHE = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass
class Generation:
    """One accepted request: its job on the worker, and what its response needs."""

    job: Job
    events: asyncio.Queue
    prompt_tokens: int
    method: str
    budget: int | None  # None unless the method is ddtree, or auto (its cap)
    include_usage: bool
    id: str
    created: int
    index: int = 0  # which of the request's sequences (its choice's index)
    silent: bool = False  # max_tokens 0: the output is dropped (the engine makes one token)


def submit(
    state: ServerState,
    endpoint: str,
    id_prefix: str,
    body: Any,
    prompt_ids: list[int],
    constraint: Constraint | None = None,
    checkpoints: tuple[int, ...] = (),
) -> list[Generation]:
    """Validate against the engine and queue a job for each of the body's `sequences()` (all,
    or none: an ApiError). `constraint`: the grammar the output follows
    (engine/server/structured.py makes it)."""
    engine = state.ready_engine()
    state.check_model(body.model)
    cfg = _generation_config(state, engine, body, prompt_ids, constraint, checkpoints)
    request_id, created = id_prefix + uuid.uuid4().hex, int(time.time())
    generations = [
        _generation(state, engine, body, prompt_ids, cfg, index, request_id, created)
        for index in range(body.sequences())
    ]
    first, *others = (generation.job for generation in generations)
    if others and engine.prefix_caching and cfg.cache_prompt and cfg.prompt_logprobs is None:
        first.followers = tuple(others)  # after the first: the prompt is cached, prefilled once
        others = []
    try:
        state.worker.submit(first, *others)
    except QueueFull as exc:
        raise ApiError(
            503, f"engine busy: {exc}; retry later", kind="server_error", code="queue_full"
        ) from None
    except ShuttingDown:
        raise ApiError(
            503, f"{SHUTTING_DOWN}; retry later", kind="server_error", code="shutting_down"
        ) from None
    state.metrics.requests.labels(endpoint, cfg.method).inc()
    return generations


def sequence_seed(seed: int | None, index: int) -> int | None:
    """The seed of a seeded request's sequence `index`: its own for the first, then one derived
    from it (the same on every run, unrelated to seed + index); None stays None (random)."""
    if seed is None or index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


def _generation(
    state: ServerState,
    engine: LoadedEngine,
    body: Any,
    prompt_ids: list[int],
    cfg: GenerationConfig,
    index: int,
    request_id: str,
    created: int,
) -> Generation:
    """Sequence `index` of a request: its job (its own seed, text and events) and what its
    answer needs."""
    cfg = dataclasses.replace(cfg, seed=sequence_seed(cfg.seed, index))
    text = TextAssembler(engine.tokenizer.decode, body.stop_strings(), cfg.stop_token_ids)
    queried = engine.prefix_caching and cfg.cache_prompt
    emit, events = _recording_emitter(
        state, cfg.method, len(prompt_ids), text, queried, whole=not body.stream
    )
    return Generation(
        job=Job(prompt_ids, cfg, text, emit=emit),
        events=events,
        prompt_tokens=len(prompt_ids),
        method=cfg.method,
        budget=cfg.budget if cfg.method in TREE_METHODS else None,
        include_usage=body.include_usage_chunk(),
        id=request_id,
        created=created,
        index=index,
        silent=body.requested_max_tokens() == 0,
    )


def _generation_config(
    state: ServerState,
    engine: LoadedEngine,
    body: Any,
    prompt_ids: list[int],
    constraint: Constraint | None,
    checkpoints: tuple[int, ...],
) -> GenerationConfig:
    max_tokens = _max_tokens(body.requested_max_tokens(), len(prompt_ids), engine)
    bias = tuple(sorted((int(token), value) for token, value in (body.logit_bias or {}).items()))
    if any(token >= engine.vocab_size for token, _ in bias):
        limit = engine.vocab_size
        raise ApiError(400, f"logit_bias: token ids must be < {limit}", param="logit_bias")
    method, budget = _speculative(state, body, engine)
    return GenerationConfig(
        method=method,
        budget=budget,
        max_new_tokens=max_tokens,
        temperature=body.temperature,
        seed=body.seed,
        stop_token_ids=tuple(engine.tokenizer.eos_token_ids),
        sampling=_sampling(body, bias),
        constraint=constraint,
        cache_prompt=body.cache_prompt,
        checkpoints=checkpoints,
        logprobs=_engine_logprobs(body),
        prompt_logprobs=body.prompt_logprobs(),
    )


def _engine_logprobs(body: Any) -> int | None:
    """The logprobs the engine computes: the asked ones, or with more sequences than are
    returned (best_of) each token's own, to rank the sequences by."""
    asked = body.output_logprobs()
    return 0 if asked is None and body.sequences() > body.n else asked


def _sampling(body: Any, logit_bias: tuple[tuple[int, float], ...] = ()) -> Sampling:
    """The body's warps, penalties and bias (its schema has checked their ranges)."""
    return Sampling(
        top_p=body.top_p,
        top_k=max(body.top_k, 0),  # vLLM's -1 and 0 both mean off
        min_p=body.min_p,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
        logit_bias=logit_bias,
    )


def _max_tokens(requested: int | None, prompt_tokens: int, engine: LoadedEngine) -> int:
    limit = engine.max_model_len
    # 0 (completions: the prompt alone): one token is made, and dropped (Generation.silent)
    max_tokens = limit - prompt_tokens if requested is None else max(requested, 1)
    if prompt_tokens + max_tokens > limit or max_tokens < 1:
        raise ApiError(
            400,
            "prompt and max_tokens exceed the context limit: "
            f"prompt has {prompt_tokens} tokens, max_tokens {max_tokens}, limit {limit}",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return max_tokens


def _speculative(state: ServerState, body: Any, engine: LoadedEngine) -> tuple[str, int]:
    """The request's method and budget, the server's where it names none: a budget named
    without a method is ddtree's, exactly (not auto's cap)."""
    choice = body.speculative
    method = (choice and choice.method) or state.config.default_method
    budget = (choice and choice.budget) or state.config.default_budget
    if method == "auto" and choice and choice.budget and not choice.method:
        method = "ddtree"
    if method != "ar" and not engine.has_drafter:
        raise ApiError(
            400,
            f"speculative method '{method}' needs a drafter; this server was started "
            "without --draft, so only 'ar' is available",
            param="speculative.method",
        )
    return method, budget


def check_prompt_ids(prompt_ids: list[int], vocab_size: int) -> None:
    if not prompt_ids:
        raise ApiError(400, "the prompt is empty (0 tokens)", param="prompt")
    if not all(0 <= token < vocab_size for token in prompt_ids):
        raise ApiError(400, f"prompt token ids must be in [0, {vocab_size})", param="prompt")


def _recording_emitter(
    state: ServerState,
    method: str,
    prompt_tokens: int,
    text: TextAssembler,
    queried: bool,
    whole: bool,
) -> tuple[Callable[[Delta | Done | Failed], None], asyncio.Queue]:
    """The job's `emit`: records a finished generation's metrics (even when its client has
    gone; `queried`: it asked the prefix cache), then hands the event to the request's handler
    (the queue returned beside it; `whole`: an answer not streamed, engine/server/handoff.py)."""
    events: asyncio.Queue = asyncio.Queue()
    put = thread_safe_put(events, whole)

    def emit(event: Delta | Done | Failed) -> None:
        if isinstance(event, Done) and event.result is not None:
            finish = _engine_finish_reason(text, event.result)
            state.metrics.observe_generation(
                method, prompt_tokens, event.result, finish, event.ttft_s
            )
            if queried:
                state.metrics.observe_prefix_cache(prompt_tokens, event.result.cached_tokens)
        put(event)

    return emit, events


# -- reading a generation ---------------------------------------------------------------------


async def events(generation: Generation) -> AsyncIterator[Delta | Done | Failed]:
    """A job's events up to and including its last (Done or Failed)."""
    while True:
        event = await generation.events.get()
        yield event
        if not isinstance(event, Delta):
            return


@dataclass(frozen=True)
class Collected:
    """A whole generation: its deltas (text and the logprobs behind it, when asked) and Done."""

    deltas: list[Delta]
    done: Done

    @property
    def text(self) -> str:
        return "".join(delta.text for delta in self.deltas)

    @property
    def logprobs(self) -> list:
        return [entry for delta in self.deltas for entry in delta.logprobs]


async def collect(request: Request, generation: Generation) -> Collected:
    """The whole generation; a client that hangs up cancels it, a Failed job raises its
    ApiError."""
    watch = asyncio.ensure_future(_wait_for_disconnect(request))
    watch.add_done_callback(lambda task: task.cancelled() or generation.job.cancel.set())
    deltas: list[Delta] = []
    try:
        async for event in events(generation):
            if isinstance(event, Delta):
                deltas.append(event)
            elif isinstance(event, Failed):
                raise failure(event)
            else:
                return Collected(deltas, event)
    finally:
        watch.cancel()
        generation.job.cancel.set()
    raise AssertionError("the worker ended a job without Done or Failed")


async def collect_all(request: Request, generations: list[Generation]) -> list[Collected]:
    """Each generation whole, in order (a failed one cancels the rest)."""
    try:
        return [await collect(request, generation) for generation in generations]
    finally:
        for generation in generations:
            generation.job.cancel.set()


async def merged_events(
    generations: list[Generation],
) -> AsyncIterator[tuple[Generation, Delta | Done | Failed]]:
    """The events of all `generations` as they come, each with its generation."""
    merged: asyncio.Queue = asyncio.Queue()

    async def forward(generation: Generation) -> None:
        async for event in events(generation):
            await merged.put((generation, event))

    tasks = [asyncio.ensure_future(forward(generation)) for generation in generations]
    try:
        ended = 0
        while ended < len(generations):
            generation, event = await merged.get()
            ended += not isinstance(event, Delta)
            yield generation, event
    finally:
        for task in tasks:
            task.cancel()


def event_stream(generations: list[Generation], lines: AsyncIterator[str]) -> StreamingResponse:
    """Server-sent `lines`; a client that hangs up cancels the generations."""

    async def guarded() -> AsyncIterator[str]:
        try:
            async for line in lines:
                yield line
        finally:
            for generation in generations:
                generation.job.cancel.set()

    return StreamingResponse(guarded(), media_type="text/event-stream", headers=NO_CACHE)


async def _wait_for_disconnect(request: Request) -> None:
    # After the body is read, the server's receive() returns only when the client hangs up.
    while (await request.receive())["type"] != "http.disconnect":
        pass


# -- what a finished generation reports -------------------------------------------------------


def finish_reason(generation: Generation, result: Any) -> str:
    """OpenAI's finish_reason: "stop" | "length", or "cancelled" (client gone, shutdown)."""
    return _engine_finish_reason(generation.job.text, result)


def _engine_finish_reason(text: TextAssembler, result: Any) -> str:
    if result is None:
        return "cancelled"
    if result.finish_reason == "cancelled" and text.stopped:
        return "stop"  # we stopped the engine: a stop string appeared
    return result.finish_reason


def usage(generation: Generation, *results: Any) -> dict:
    """The prompt counted once, the output of every sequence (`results`) of the request (none
    when silent); the cached tokens are the first sequence's (the others reuse its prefill)."""
    outputs = [len(result.output_ids) for result in results if result is not None]
    completion = 0 if generation.silent else sum(outputs)
    cached = results[0].cached_tokens if results and results[0] is not None else 0
    return {
        "prompt_tokens": generation.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": generation.prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def speculative_stats(generation: Generation, done: Done) -> dict:
    """`ttft_s` counts the time the request waited in the queue."""
    stats = {"method": generation.method, "budget": generation.budget, "rounds": 0}
    result = done.result
    if result is None:
        return stats
    lengths = result.acceptance_lengths
    return {
        **stats,
        "rounds": len(lengths),
        "mean_acceptance_length": statistics.fmean(lengths) if lengths else 0.0,
        "decode_tokens_per_s": result.decode_tokens_per_s,
        "ttft_s": done.ttft_s,
        **({"budgets": budget_summary(result.budgets)} if result.budgets is not None else {}),
    }


def budget_summary(budgets: list[int]) -> dict:
    """auto's chosen node counts, kept small: their mean and rounds by count."""
    histogram = {str(count): budgets.count(count) for count in sorted(set(budgets))}
    return {"mean": statistics.fmean(budgets) if budgets else 0.0, "histogram": histogram}


def failure(event: Failed) -> ApiError:
    return ApiError(event.status, event.message, kind="server_error", code=event.code)


def sse(payload: dict, event: str | None = None) -> str:
    """One server-sent event; `event` names it (the Responses API's streams name theirs)."""
    named = f"event: {event}\n" if event else ""
    return f"{named}data: {json.dumps(payload, separators=(',', ':'))}\n\n"
