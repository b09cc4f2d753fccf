"""The engine's OpenAI-compatible HTTP server (FastAPI): `create_app(load, config)`.

Run it with `python -m engine serve --model DIR [--draft DIR] ...` (engine/cli/serve.py).

Endpoints: `GET /v1/models` (and `/v1/models/{id}`), `POST /v1/completions`,
`POST /v1/chat/completions` (both with `"stream": true` as server-sent events ending in
`data: [DONE]`), `POST /v1/responses` (the Responses API, streamed as its named events),
`POST /tokenize`,
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

Beyond OpenAI's fields, a request may carry `"speculative": {"method": "ar"|"linear"|"ddtree"|
"auto", "budget": N}` (defaults from the server's flags; a budget named without a method is
ddtree's), and every response carries `"speculative": {"method", "budget", "rounds",
"mean_acceptance_length", "decode_tokens_per_s", "ttft_s"}`, with auto's chosen `"budgets":
{"mean", "histogram"}` (rounds by node count).

Layout: a module per API (engine/server/completions.py, chat_completions.py, responses.py:
OpenAI's Responses API, translated onto chat's path) over one shared
generation path (engine/server/generation.py: submit to the worker, events, usage, errors) and
one state (engine/server/state.py); this module builds the app, serves the service endpoints
(health, readiness, metrics, models, tokenize) and loads the engine for `serve`.

Boundary: the server knows HTTP, JSON and text; the engine (`engine.decode.generate`) knows
token ids only. Generations run on the worker thread (engine/server/worker.py), up to
--max-num-seqs at once through the scheduler (engine/scheduler.py);
`load` runs there too, so /health answers while a large model loads. A request body is read up
to `max_request_bytes` (else 413, engine/server/body.py), then parsed, rendered with the chat
template and tokenised on a small thread pool, so a large prompt never holds up the event loop.
At shutdown, requests in flight get `shutdown_grace_s`, then a 503 (engine/server/shutdown.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from engine.decode import GenerationConfig
from engine.scheduler import DEFAULT_MAX_NUM_BATCHED_TOKENS
from engine.server import chat_completions, completions, responses
from engine.server.chat import build_chat_prompt
from engine.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from engine.server.schemas import ApiError, ChatTemplateInputs, TokenizeRequest, parse_body
from engine.server.state import LoadedEngine, ServerConfig, ServerState
from engine.server.structured import grammar_tokenizer

log = logging.getLogger(__name__)


def load_engine(
    model_dir: str | Path,
    draft_dir: str | Path | None = None,
    dtype: str = "float32",
    device: str = "cpu",
    max_model_len: int | None = None,
    tp: int = 1,
    prefix_cache_bytes: int = 0,
    max_num_seqs: int = 1,
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
    options: dict | None = None,
    kv_tokens: int | None = None,
) -> LoadedEngine:
    """Load the target (and drafter) and the model directory's tokenizer for serving.

    `max_model_len` defaults to the target's max_position_embeddings; `tp` > 1 spreads the
    target over that many tensor-parallel ranks (engine/parallel.py). On one rank up to
    `max_num_seqs` sequences decode at once (engine/scheduler.py), each in caches allocated
    once (engine/cache_pool.py), beside a prefix cache of `prefix_cache_bytes` (0: none);
    over several, one sequence at a time in its own caches and no prefix cache (every rank
    would have to restore its share, and its passes are not batched), which is logged.
    `options`: GenerationConfig fields the scheduler gives every request (serve's flags).
    `kv_tokens`: the sequences' KV block pool holds that many tokens, not `max_num_seqs` whole
    contexts (serve's --kv-cache-tokens): the scheduler preempts when it runs short.
    """
    import torch

    from engine.cache_pool import CachePool
    from engine.decode import generate
    from engine.models import load_drafter
    from engine.parallel import open_target
    from engine.scheduler import Scheduler
    from engine.tokenizer import load_tokenizer

    torch_dtype = getattr(torch, dtype)
    target = open_target(model_dir, torch_dtype, device, tp)
    drafter = load_drafter(draft_dir, dtype=torch_dtype, device=device) if draft_dir else None
    limit = max_model_len or target.config.max_position_embeddings
    pool, scheduler = None, None
    if tp == 1:
        pool = CachePool.for_server(target, drafter, limit, prefix_cache_bytes)
        slots = pool.slots(max_num_seqs, kv_tokens)
        scheduler = Scheduler(target, drafter, slots, max_num_batched_tokens, options)
        log.info(
            "cache pool: %d slots of %d tokens, KV block pools %.1f MiB (the prefix cache's "
            "share included)",
            max_num_seqs,
            limit,
            pool.kv_bytes / (1 << 20),
        )
    else:
        log.info(
            "tensor parallel (--tp %d): one sequence at a time (--max-num-seqs %d not used)%s",
            tp,
            max_num_seqs,
            ", no prefix cache; every prompt is prefilled" if prefix_cache_bytes else "",
        )

    def bound_generate(prompt_ids: list[int], cfg: GenerationConfig, *, on_tokens=None, **rest):
        if pool is None:
            return generate(target, drafter, prompt_ids, cfg, on_tokens=on_tokens, **rest)

        def attempt(callback):
            return generate(target, drafter, prompt_ids, cfg, on_tokens=callback, pool=pool, **rest)

        return pool.run(attempt, on_tokens)

    tokenizer = load_tokenizer(model_dir)
    vocab = target.config.vocab_size
    return LoadedEngine(
        generate=bound_generate,
        tokenizer=tokenizer,
        max_model_len=limit,
        vocab_size=vocab,
        has_drafter=drafter is not None,
        grammar_tokenizer=grammar_tokenizer(tokenizer, vocab),
        prefix_caching=pool is not None and pool.prefix_cache is not None,
        scheduler=scheduler,
    )


def create_app(
    load: Callable[[], LoadedEngine],
    config: ServerConfig,
    on_fatal: Callable[[], None] = lambda: None,
) -> FastAPI:
    """The FastAPI app; `load` runs on the worker thread at start-up, then a 1-token warm-up."""
    state = ServerState(config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.worker.start(lambda: state.start_engine(load), on_fatal)
        yield
        await asyncio.to_thread(state.worker.stop)
        state.prepare_pool.shutdown(wait=False, cancel_futures=True)

    # No /docs or /openapi.json: they would be the only unauthenticated pages.
    app = FastAPI(
        title="ddops engine", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.state.server = state
    app.add_exception_handler(ApiError, state.api_error_response)
    app.add_exception_handler(HTTPException, _http_error(state))
    app.add_exception_handler(RequestValidationError, _validation_error(state))
    app.include_router(_open_routes(state))
    protected = [Depends(state.require_api_key)]
    app.include_router(_service_routes(state), dependencies=protected)
    for api in (completions, chat_completions, responses):
        app.include_router(api.router(state), dependencies=protected)
    return app


def _open_routes(state: ServerState) -> APIRouter:
    async def health(ready: bool = False) -> JSONResponse:
        return await ready_page() if ready else JSONResponse({"status": "ok"})

    async def ready_page() -> JSONResponse:
        if state.worker.ready.is_set():
            ready = {"status": "ready", "model": state.config.model_name}
            return JSONResponse({**ready, "max_model_len": state.engine.max_model_len})
        if state.worker.startup_error:
            return JSONResponse({"status": "failed", "error": state.worker.startup_error}, 503)
        return JSONResponse({"status": "loading"}, 503)

    router = APIRouter()
    router.add_api_route("/health", health, methods=["GET"])
    router.add_api_route("/ready", ready_page, methods=["GET"])
    return router


def _http_error(state: ServerState):
    """Starlette's own errors (an unknown route, a method the route lacks) in OpenAI's shape."""

    async def handle(request: Request, exc: HTTPException) -> JSONResponse:
        if exc.status_code in (404, 405):
            message = f"Invalid URL ({request.method} {request.url.path})"  # OpenAI's words
        else:
            message = str(exc.detail)
        error = ApiError(exc.status_code, message)
        response = await state.api_error_response(request, error)
        response.headers.update(exc.headers or {})
        return response

    return handle


def _validation_error(state: ServerState):
    """FastAPI's checks of query and path parameters: a 400 naming the first bad one."""

    async def handle(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        param = ".".join(str(part) for part in first["loc"][1:]) or None
        error = ApiError(400, f"{param}: {first['msg']}" if param else first["msg"], param=param)
        return await state.api_error_response(request, error)

    return handle


def _service_routes(state: ServerState) -> APIRouter:
    def card() -> dict:
        return {
            "id": state.config.model_name,
            "object": "model",
            "created": state.started,
            "owned_by": "ddops",
            "max_model_len": state.ready_engine().max_model_len,
        }

    async def models() -> dict:
        return {"object": "list", "data": [card()]}

    async def model(model: str) -> dict:
        state.check_model(model)
        return card()

    async def metrics_text() -> Response:
        state.metrics.queue_waiting.set(state.worker.waiting)
        state.metrics.waiting.set(state.worker.waiting)
        state.metrics.running.set(state.worker.running)
        return Response(state.metrics.render(), media_type=METRICS_CONTENT_TYPE)

    async def tokenize(request: Request) -> JSONResponse:
        return await state.prepare(lambda raw: _tokenize(state, raw), request)

    router = APIRouter()
    router.add_api_route("/v1/models", models, methods=["GET"])
    router.add_api_route("/v1/models/{model:path}", model, methods=["GET"])
    router.add_api_route("/tokenize", tokenize, methods=["POST"])
    router.add_api_route("/metrics", metrics_text, methods=["GET"])
    return router


def _tokenize(state: ServerState, raw: bytes) -> JSONResponse:
    """The whole answer, serialised here too: a long prompt's ids are megabytes of JSON."""
    body = parse_body(TokenizeRequest, raw)
    engine = state.ready_engine()
    state.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise ApiError(400, "give exactly one of 'prompt' or 'messages'", param="prompt")
    if body.prompt is not None:
        ids = engine.tokenizer.encode(body.prompt)
    else:
        chat = build_chat_prompt(
            parse_body(ChatTemplateInputs, raw), engine.tokenizer, state.parsing
        )
        ids = engine.tokenizer.encode(chat.text)
    return JSONResponse({"count": len(ids), "tokens": ids, "max_model_len": engine.max_model_len})
