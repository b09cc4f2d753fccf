"""The engine's OpenAI-compatible HTTP server (FastAPI): `create_app(load, config)`.

Run it with `python -m engine serve --model DIR [--draft DIR] ...` (engine/cli/serve.py).

Endpoints: `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions` (both with
`"stream": true` as server-sent events ending in `data: [DONE]`), `POST /tokenize`,
`GET /health` (alive), `GET /ready` or `/health?ready=1` (model loaded and a 1-token generation
succeeded), `GET /metrics` (Prometheus text). With an API key, every endpoint but /health and
/ready needs `Authorization: Bearer <key>`.

Chat requests may carry `tools`, `tool_choice`, `parallel_tool_calls`, assistant `tool_calls`,
`tool` messages and `chat_template_kwargs` (e.g. `{"enable_thinking": false}`), rendered by the
model's own chat template; tool calls in the output come back as `tool_calls` (finish_reason
"tool_calls") and `<think>` reasoning as `reasoning_content`, streamed or not (engine/server/chat.py;
the parsers follow the template, `--tool-call-parser` / `--reasoning-parser` override them).
An OpenAI field the server does not implement is a 400 naming it; a field outside the API is
ignored with a logged warning (engine/server/schemas.py).

Beyond OpenAI's fields, a request may carry `"speculative": {"method": "ar"|"linear"|"ddtree",
"budget": N}` (defaults from the server's flags), and every response carries `"speculative":
{"method", "budget", "rounds", "mean_acceptance_length", "decode_tokens_per_s", "ttft_s"}`.

Boundary: this module knows HTTP, JSON and text; the engine (`engine.decode.generate`) knows
token ids only. Generations run one at a time on the worker thread (engine/server/worker.py);
`load` runs there too, so /health answers while a large model loads. A request body is read up
to `max_request_bytes` (else 413, engine/server/body.py), then parsed, rendered with the chat
template and tokenised on a small thread pool, so a large prompt never holds up the event loop.
At shutdown, requests in flight get `shutdown_grace_s`, then a 503 (engine/server/shutdown.py).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import statistics
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from engine.decode import GenerationConfig
from engine.server.body import DEFAULT_MAX_REQUEST_BYTES, read_body
from engine.server.chat import ChatOutput, ChatPrompt, OutputParsing, build_chat_prompt
from engine.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from engine.server.metrics import ServerMetrics
from engine.server.schemas import (
    ApiError,
    ChatRequest,
    ChatTemplateInputs,
    CompletionRequest,
    TokenizeRequest,
    parse_body,
)
from engine.server.text import TextAssembler
from engine.server.tools import FORMATS, detect_format
from engine.server.worker import (
    SHUTTING_DOWN,
    Delta,
    Done,
    Failed,
    GenerateFn,
    GenerationWorker,
    Job,
    QueueFull,
    ShuttingDown,
)

log = logging.getLogger(__name__)

# Threads that parse, render and tokenise request bodies (the tokenizer releases the GIL).
PREPARE_THREADS = 4


class Tokenizer(Protocol):
    """What the server needs from engine.tokenizer.load_tokenizer(model_dir)."""

    eos_token_ids: Any  # a collection of ints
    chat_template: str | None

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...
    def render_chat(
        self, messages: list[dict], add_generation_prompt: bool = True, **kw
    ) -> str: ...


@dataclass(frozen=True)
class LoadedEngine:
    """A loaded model pair, as the server uses it."""

    generate: GenerateFn  # (prompt_ids, cfg, *, on_tokens, should_stop) -> GenerationResult
    tokenizer: Tokenizer
    max_model_len: int
    vocab_size: int
    has_drafter: bool


@dataclass(frozen=True)
class ServerConfig:
    model_name: str
    default_method: str = "ddtree"
    default_budget: int = 15
    api_key: str | None = None
    max_waiting: int = 32
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    shutdown_grace_s: float = 5.0  # at shutdown, requests in flight get this long, then a 503
    tool_call_parser: str = "auto"  # "auto" (from the chat template), "none" or a FORMATS name
    reasoning_parser: str = "auto"  # "auto" (if the template thinks), "none" or "qwen3"


def output_parsing(config: ServerConfig, chat_template: str | None) -> OutputParsing:
    """The parsers for the model's output: the flags', else what its chat template teaches."""
    if config.tool_call_parser == "auto":
        tool_format = detect_format(chat_template)
    else:
        tool_format = FORMATS.get(config.tool_call_parser)
    if config.reasoning_parser == "auto":
        reasoning = "<think>" in (chat_template or "")
    else:
        reasoning = config.reasoning_parser == "qwen3"
    return OutputParsing(tool_format, reasoning)


def load_engine(
    model_dir: str | Path,
    draft_dir: str | Path | None = None,
    dtype: str = "float32",
    device: str = "cpu",
    max_model_len: int | None = None,
    tp: int = 1,
) -> LoadedEngine:
    """Load the target (and drafter) and the model directory's tokenizer for serving.

    `max_model_len` defaults to the target's max_position_embeddings; `tp` > 1 spreads the
    target over that many tensor-parallel ranks (engine/parallel.py).
    """
    import torch

    from engine.decode import generate
    from engine.models import load_drafter
    from engine.parallel import open_target
    from engine.tokenizer import load_tokenizer

    torch_dtype = getattr(torch, dtype)
    target = open_target(model_dir, torch_dtype, device, tp)
    drafter = load_drafter(draft_dir, dtype=torch_dtype, device=device) if draft_dir else None
    limit = max_model_len or target.config.max_position_embeddings

    def bound_generate(prompt_ids: list[int], cfg: GenerationConfig, **callbacks):
        return generate(target, drafter, prompt_ids, cfg, **callbacks)

    return LoadedEngine(
        generate=bound_generate,
        tokenizer=load_tokenizer(model_dir),
        max_model_len=limit,
        vocab_size=target.config.vocab_size,
        has_drafter=drafter is not None,
    )


def create_app(
    load: Callable[[], LoadedEngine],
    config: ServerConfig,
    on_fatal: Callable[[], None] = lambda: None,
) -> FastAPI:
    """The FastAPI app; `load` runs on the worker thread at start-up, then a 1-token warm-up."""
    server = _Server(config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.worker.start(lambda: server.start_engine(load), on_fatal)
        yield
        await asyncio.to_thread(server.worker.stop)
        server.prepare_pool.shutdown(wait=False, cancel_futures=True)

    # No /docs or /openapi.json: they would be the only unauthenticated pages.
    app = FastAPI(
        title="ddops engine", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.state.server = server
    app.add_exception_handler(ApiError, server.api_error_response)
    app.include_router(server.open_routes())
    app.include_router(server.protected_routes())
    return app


@dataclass(frozen=True)
class _Shape:
    """How one endpoint dresses output into OpenAI objects (completions vs chat completions)."""

    endpoint: str
    id_prefix: str
    object: str
    chunk_object: str
    chat: bool

    def choice(self, output: str | dict, finish: str | None) -> dict:
        """`output`: the text (completions) or the assistant message (chat)."""
        body = {"message": output} if self.chat else {"text": output}
        return {"index": 0, **body, "logprobs": None, "finish_reason": finish}

    def chunk_choice(self, output: str | dict, finish: str | None) -> dict:
        """`output`: a text delta (completions) or a message delta (chat)."""
        body = {"delta": output} if self.chat else {"text": output}
        return {"index": 0, **body, "logprobs": None, "finish_reason": finish}


_COMPLETIONS = _Shape("/v1/completions", "cmpl-", "text_completion", "text_completion", chat=False)
_CHAT = _Shape(
    "/v1/chat/completions", "chatcmpl-", "chat.completion", "chat.completion.chunk", chat=True
)


@dataclass
class _Generation:
    """One accepted request: its job on the worker, and what its response needs."""

    shape: _Shape
    job: Job
    events: asyncio.Queue
    prompt_tokens: int
    method: str
    budget: int | None
    include_usage: bool
    id: str
    created: int
    output: ChatOutput | None = None  # chat: text -> content, reasoning and tool-call deltas


class _Server:
    """The app's state and handlers (one per app, so tests can run several)."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.metrics = ServerMetrics()
        self.worker = GenerationWorker(config.max_waiting)
        self.prepare_pool = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="engine-prepare")
        self.engine: LoadedEngine | None = None
        self.parsing = OutputParsing(None, False)
        self.started = int(time.time())

    # -- start-up ---------------------------------------------------------------------------

    def start_engine(self, load: Callable[[], LoadedEngine]) -> GenerateFn:
        """Load the models and prove them with a 1-token generation (runs on the worker)."""
        engine = load()
        warm_up_ids = engine.tokenizer.encode("Hello") or [0]
        cfg = GenerationConfig(
            method=self.config.default_method,
            budget=self.config.default_budget,
            max_new_tokens=1,
            temperature=0.0,
        )
        result = engine.generate(warm_up_ids, cfg)
        if len(result.output_ids) != 1:
            raise RuntimeError(f"warm-up generated {len(result.output_ids)} tokens, not 1")
        self.parsing = output_parsing(self.config, engine.tokenizer.chat_template)
        self.engine = engine
        log.info(
            "engine ready: %s, max_model_len %d, tool-call parser %s, reasoning parser %s",
            self.config.model_name,
            engine.max_model_len,
            self.parsing.tool_format.name if self.parsing.tool_format else "none",
            "qwen3" if self.parsing.reasoning else "none",
        )
        return engine.generate

    def begin_shutdown(self) -> None:
        """The server is stopping (engine/server/shutdown.py): requests running or waiting get
        `shutdown_grace_s` to finish, then the worker cuts them (each answered 503)."""
        grace = self.config.shutdown_grace_s
        log.info("shutting down: requests in flight get %g s to finish, then a 503", grace)
        asyncio.get_running_loop().call_later(grace, self.worker.cut)

    # -- routes -----------------------------------------------------------------------------

    def open_routes(self) -> APIRouter:
        router = APIRouter()
        router.add_api_route("/health", self.health, methods=["GET"])
        router.add_api_route("/ready", self.ready, methods=["GET"])
        return router

    def protected_routes(self) -> APIRouter:
        router = APIRouter(dependencies=[Depends(self.require_api_key)])
        router.add_api_route("/v1/models", self.models, methods=["GET"])
        router.add_api_route("/v1/completions", self.completions, methods=["POST"])
        router.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])
        router.add_api_route("/tokenize", self.tokenize, methods=["POST"])
        router.add_api_route("/metrics", self.metrics_text, methods=["GET"])
        return router

    async def require_api_key(self, request: Request) -> None:
        expected = self.config.api_key
        if not expected:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            given.strip().encode(), expected.encode()
        ):
            raise ApiError(401, "invalid or missing API key", code="invalid_api_key")

    async def health(self, ready: bool = False) -> JSONResponse:
        return await self.ready() if ready else JSONResponse({"status": "ok"})

    async def ready(self) -> JSONResponse:
        if self.worker.ready.is_set():
            ready = {"status": "ready", "model": self.config.model_name}
            return JSONResponse({**ready, "max_model_len": self.engine.max_model_len})
        if self.worker.startup_error:
            return JSONResponse({"status": "failed", "error": self.worker.startup_error}, 503)
        return JSONResponse({"status": "loading"}, 503)

    async def models(self) -> dict:
        engine = self._ready_engine()
        card = {
            "id": self.config.model_name,
            "object": "model",
            "created": self.started,
            "owned_by": "ddops",
            "max_model_len": engine.max_model_len,
        }
        return {"object": "list", "data": [card]}

    async def metrics_text(self) -> Response:
        self.metrics.queue_waiting.set(self.worker.waiting)
        return Response(self.metrics.render(), media_type=METRICS_CONTENT_TYPE)

    async def tokenize(self, request: Request) -> JSONResponse:
        return await self._prepare(self._tokenize_body, request)

    async def completions(self, request: Request) -> Response:
        body, prompt_ids = await self._prepare(self._completion_prompt, request)
        return await self._serve(request, _COMPLETIONS, body, prompt_ids)

    async def chat_completions(self, request: Request) -> Response:
        body, prompt_ids, chat = await self._prepare(self._chat_prompt, request)
        return await self._serve(request, _CHAT, body, prompt_ids, ChatOutput(chat))

    # -- request bodies (on the prepare pool) -----------------------------------------------

    async def _prepare(self, prepare: Callable[[bytes], Any], request: Request) -> Any:
        """Read the body within the size limit, then run `prepare(raw)` off the event loop."""
        raw = await read_body(request, self.config.max_request_bytes)
        return await asyncio.get_running_loop().run_in_executor(self.prepare_pool, prepare, raw)

    def _tokenize_body(self, raw: bytes) -> JSONResponse:
        """The whole answer, serialised here too: a long prompt's ids are megabytes of JSON."""
        body = parse_body(TokenizeRequest, raw)
        engine = self._ready_engine()
        self._check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "give exactly one of 'prompt' or 'messages'", param="prompt")
        if body.prompt is not None:
            ids = engine.tokenizer.encode(body.prompt)
        else:
            chat = build_chat_prompt(
                parse_body(ChatTemplateInputs, raw), engine.tokenizer, self.parsing
            )
            ids = engine.tokenizer.encode(chat.text)
        return JSONResponse(
            {"count": len(ids), "tokens": ids, "max_model_len": engine.max_model_len}
        )

    def _completion_prompt(self, raw: bytes) -> tuple[CompletionRequest, list[int]]:
        body = parse_body(CompletionRequest, raw)
        engine = self._ready_engine()
        if isinstance(body.prompt, str):
            prompt_ids = engine.tokenizer.encode(body.prompt)
        else:
            prompt_ids = list(body.prompt)
        _check_prompt_ids(prompt_ids, engine.vocab_size)
        return body, prompt_ids

    def _chat_prompt(self, raw: bytes) -> tuple[ChatRequest, list[int], ChatPrompt]:
        body = parse_body(ChatRequest, raw)
        engine = self._ready_engine()
        chat = build_chat_prompt(body, engine.tokenizer, self.parsing)
        prompt_ids = engine.tokenizer.encode(chat.text)
        _check_prompt_ids(prompt_ids, engine.vocab_size)
        return body, prompt_ids, chat

    # -- generation -------------------------------------------------------------------------

    async def _serve(
        self,
        request: Request,
        shape: _Shape,
        body: CompletionRequest | ChatRequest,
        prompt_ids: list[int],
        output: ChatOutput | None = None,
    ) -> Response:
        generation = self._submit(shape, body, prompt_ids)
        generation.output = output
        self.metrics.requests.labels(shape.endpoint, generation.method).inc()
        if body.stream:
            return StreamingResponse(
                self._stream(generation), media_type="text/event-stream", headers=_NO_CACHE
            )
        return await self._complete(request, generation)

    def _submit(self, shape: _Shape, body, prompt_ids: list[int]) -> _Generation:
        """Validate against the engine, queue the job, or raise an ApiError."""
        engine = self._ready_engine()
        self._check_model(body.model)
        max_tokens = self._max_tokens(body.requested_max_tokens(), len(prompt_ids), engine)
        method, budget = self._speculative(body, engine)
        stop_ids = tuple(engine.tokenizer.eos_token_ids)
        cfg = GenerationConfig(
            method=method,
            budget=budget,
            max_new_tokens=max_tokens,
            temperature=body.temperature,
            seed=body.seed,
            stop_token_ids=stop_ids,
        )
        text = TextAssembler(engine.tokenizer.decode, body.stop_strings(), stop_ids)
        events: asyncio.Queue = asyncio.Queue()
        emit = self._recording_emitter(events, method, len(prompt_ids), text)
        job = Job(prompt_ids, cfg, text, emit=emit)
        try:
            self.worker.submit(job)
        except QueueFull as exc:
            raise ApiError(
                503, f"engine busy: {exc}; retry later", kind="server_error", code="queue_full"
            ) from None
        except ShuttingDown:
            raise ApiError(
                503, f"{SHUTTING_DOWN}; retry later", kind="server_error", code="shutting_down"
            ) from None
        return _Generation(
            shape=shape,
            job=job,
            events=events,
            prompt_tokens=len(prompt_ids),
            method=method,
            budget=budget if method == "ddtree" else None,
            include_usage=body.include_usage_chunk(),
            id=shape.id_prefix + uuid.uuid4().hex,
            created=int(time.time()),
        )

    def _recording_emitter(
        self, events: asyncio.Queue, method: str, prompt_tokens: int, text: TextAssembler
    ) -> Callable[[Delta | Done | Failed], None]:
        """The job's `emit`: records a finished generation's metrics (even when its client has
        gone), then hands the event to the request's handler."""
        put = _thread_safe_put(events)

        def emit(event: Delta | Done | Failed) -> None:
            if isinstance(event, Done) and event.result is not None:
                finish = _finish_reason(text, event.result)
                self.metrics.observe_generation(method, prompt_tokens, event.result, finish)
            put(event)

        return emit

    async def _complete(self, request: Request, generation: _Generation) -> JSONResponse:
        """Collect the whole generation; a client that hangs up cancels it."""
        watch = asyncio.ensure_future(_wait_for_disconnect(request))
        watch.add_done_callback(lambda task: task.cancelled() or generation.job.cancel.set())
        pieces: list[str] = []
        try:
            async for event in _events(generation.events):
                if isinstance(event, Delta):
                    pieces.append(event.text)
                elif isinstance(event, Failed):
                    raise _failure(event)
                else:
                    return JSONResponse(self._final_body(generation, "".join(pieces), event))
        finally:
            watch.cancel()
            generation.job.cancel.set()
        raise AssertionError("the worker ended a job without Done or Failed")

    async def _stream(self, generation: _Generation) -> AsyncIterator[str]:
        """Server-sent events; a client that hangs up cancels the generation (finally)."""
        shape = generation.shape
        try:
            if shape.chat:
                first = {"role": "assistant", "content": ""}
                yield _sse(self._chunk(generation, shape.chunk_choice(first, None)))
            async for event in _events(generation.events):
                if isinstance(event, Delta):
                    for delta in _deltas(generation, event.text):
                        yield _sse(self._chunk(generation, shape.chunk_choice(delta, None)))
                elif isinstance(event, Failed):
                    self._count_error(shape.endpoint, event.status)
                    yield _sse(_failure(event).body())
                elif event.result is not None:
                    for chunk in self._final_chunks(generation, event):
                        yield _sse(chunk)
            yield "data: [DONE]\n\n"
        finally:
            generation.job.cancel.set()

    def _chunk(self, generation: _Generation, choice: dict | None, **extra) -> dict:
        return {
            "id": generation.id,
            "object": generation.shape.chunk_object,
            "created": generation.created,
            "model": self.config.model_name,
            "choices": [choice] if choice else [],
            **extra,
        }

    def _final_chunks(self, generation: _Generation, done: Done) -> list[dict]:
        shape = generation.shape
        chunks = []
        if generation.output is not None:
            for delta in generation.output.finish():
                chunks.append(self._chunk(generation, shape.chunk_choice(delta, None)))
        finish = _response_finish_reason(generation, done.result)
        choice = shape.chunk_choice({} if shape.chat else "", finish)
        stats = self._speculative_stats(generation, done.result)
        chunks.append(self._chunk(generation, choice, speculative=stats))
        if generation.include_usage:
            chunks.append(self._chunk(generation, None, usage=self._usage(generation, done.result)))
        return chunks

    def _final_body(self, generation: _Generation, text: str, done: Done) -> dict:
        result = done.result
        output: str | dict = text
        if generation.output is not None:
            deltas = generation.output.feed(text) + generation.output.finish()
            output = generation.output.message(deltas)
        finish = _response_finish_reason(generation, result)
        return {
            "id": generation.id,
            "object": generation.shape.object,
            "created": generation.created,
            "model": self.config.model_name,
            "choices": [generation.shape.choice(output, finish)],
            "usage": self._usage(generation, result),
            "speculative": self._speculative_stats(generation, result),
        }

    def _usage(self, generation: _Generation, result) -> dict:
        completion = len(result.output_ids) if result is not None else 0
        return {
            "prompt_tokens": generation.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": generation.prompt_tokens + completion,
        }

    def _speculative_stats(self, generation: _Generation, result) -> dict:
        stats = {"method": generation.method, "budget": generation.budget, "rounds": 0}
        if result is None:
            return stats
        lengths = result.acceptance_lengths
        return {
            **stats,
            "rounds": len(lengths),
            "mean_acceptance_length": statistics.fmean(lengths) if lengths else 0.0,
            "decode_tokens_per_s": result.decode_tokens_per_s,
            "ttft_s": result.ttft_s,
        }

    # -- validation -------------------------------------------------------------------------

    def _ready_engine(self) -> LoadedEngine:
        if self.engine is None or not self.worker.ready.is_set():
            why = self.worker.startup_error or "the model is still loading"
            raise ApiError(503, f"engine not ready: {why}", kind="server_error", code="not_ready")
        return self.engine

    def _check_model(self, model: str | None) -> None:
        if model and model != self.config.model_name:
            raise ApiError(
                400,
                f"model '{model}' is not served here; this server serves '{self.config.model_name}'",
                param="model",
                code="model_not_found",
            )

    @staticmethod
    def _max_tokens(requested: int | None, prompt_tokens: int, engine: LoadedEngine) -> int:
        limit = engine.max_model_len
        max_tokens = limit - prompt_tokens if requested is None else requested
        if prompt_tokens + max_tokens > limit or max_tokens < 1:
            raise ApiError(
                400,
                "prompt and max_tokens exceed the context limit: "
                f"prompt has {prompt_tokens} tokens, max_tokens {max_tokens}, limit {limit}",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return max_tokens

    def _speculative(self, body, engine: LoadedEngine) -> tuple[str, int]:
        choice = body.speculative
        method = (choice and choice.method) or self.config.default_method
        budget = (choice and choice.budget) or self.config.default_budget
        if method != "ar" and not engine.has_drafter:
            raise ApiError(
                400,
                f"speculative method '{method}' needs a drafter; this server was started "
                "without --draft, so only 'ar' is available",
                param="speculative.method",
            )
        return method, budget

    # -- errors -----------------------------------------------------------------------------

    async def api_error_response(self, request: Request, exc: ApiError) -> JSONResponse:
        self._count_error(request.url.path, exc.status)
        headers = {"Retry-After": "1"} if exc.status == 503 else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    def _count_error(self, endpoint: str, status: int) -> None:
        self.metrics.errors.labels(endpoint, str(status)).inc()


_NO_CACHE = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _finish_reason(text: TextAssembler, result) -> str:
    """OpenAI's finish_reason: "stop" | "length", or "cancelled" (client gone, shutdown)."""
    if result is None:
        return "cancelled"
    if result.finish_reason == "cancelled" and text.stopped:
        return "stop"  # we stopped the engine: a stop string appeared
    return result.finish_reason


def _response_finish_reason(generation: _Generation, result) -> str:
    """The finish_reason a response reports: "tool_calls" when a finished turn called tools."""
    finish = _finish_reason(generation.job.text, result)
    output = generation.output
    return "tool_calls" if finish == "stop" and output is not None and output.calls else finish


def _deltas(generation: _Generation, text: str) -> list[str | dict]:
    """A text delta as the stream's choice deltas: itself (completions), or chat message deltas."""
    if generation.output is None:
        return [text]
    return generation.output.feed(text)


def _check_prompt_ids(prompt_ids: list[int], vocab_size: int) -> None:
    if not prompt_ids:
        raise ApiError(400, "the prompt is empty (0 tokens)", param="prompt")
    if not all(0 <= token < vocab_size for token in prompt_ids):
        raise ApiError(400, f"prompt token ids must be in [0, {vocab_size})", param="prompt")


def _failure(event: Failed) -> ApiError:
    return ApiError(event.status, event.message, kind="server_error", code=event.code)


def _thread_safe_put(events: asyncio.Queue) -> Callable[[Any], None]:
    """An `emit` for the worker thread that puts into `events` on this event loop."""
    loop = asyncio.get_running_loop()

    def put(event: Any) -> None:
        if not loop.is_closed():
            loop.call_soon_threadsafe(events.put_nowait, event)

    return put


async def _events(events: asyncio.Queue) -> AsyncIterator[Delta | Done | Failed]:
    """A job's events up to and including its last (Done or Failed)."""
    while True:
        event = await events.get()
        yield event
        if not isinstance(event, Delta):
            return


async def _wait_for_disconnect(request: Request) -> None:
    # After the body is read, the server's receive() returns only when the client hangs up.
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"
