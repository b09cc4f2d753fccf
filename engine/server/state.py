"""The server's state, shared by every API module: its config, the loaded engine, the worker.

`ServerState` is one per app (tests run several): the worker thread that runs generations, the
pool that parses, renders and tokenises request bodies, the metrics, and the engine once loaded.
The API modules (engine/server/completions.py, chat_completions.py, ...) take it as their one
argument; engine/server/app.py builds it and the app around it.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse
from llguidance import LLTokenizer

from engine.decode import GenerationConfig, GenerationResult
from engine.scheduler import EngineLoop, Finished, GenerateFn, Scheduler, SerialLoop
from engine.scheduler import Request as EngineRequest
from engine.server.body import DEFAULT_MAX_REQUEST_BYTES, read_body
from engine.server.chat import OutputParsing
from engine.server.metrics import ServerMetrics
from engine.server.schemas import ApiError
from engine.server.tools import FORMATS, detect_format
from engine.server.worker import GenerationWorker

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
    grammar_tokenizer: LLTokenizer | None = None  # structured output (engine/server/structured.py)
    prefix_caching: bool = False  # requests may reuse a prefix cache (engine/prefix_cache.py)
    scheduler: Scheduler | None = None  # batches the requests; None: `generate` one at a time


@dataclass(frozen=True)
class ServerConfig:
    model_name: str
    default_method: str = "auto"
    default_budget: int = 15
    api_key: str | None = None
    max_waiting: int = 32
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    shutdown_grace_s: float = 5.0  # at shutdown, requests in flight get this long, then a 503
    tool_call_parser: str = "auto"  # "auto" (from the chat template), "none" or a FORMATS name
    reasoning_parser: str = "auto"  # "auto" (if the template thinks), "none" or "qwen3"


def _run_alone(loop: EngineLoop, prompt_ids: list[int], cfg: GenerationConfig) -> GenerationResult:
    """One request through `loop` with nothing else running; its error is raised."""
    finished: list[Finished] = []
    loop.add(EngineRequest(prompt_ids, cfg, on_finish=finished.append))
    while not loop.idle:
        loop.step()
    if finished[0].error is not None:
        raise finished[0].error
    return finished[0].result


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


class ServerState:
    """The app's state: config, metrics, the worker and its engine, the prepare pool."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.metrics = ServerMetrics()
        self.worker = GenerationWorker(config.max_waiting)
        self.prepare_pool = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="engine-prepare")
        self.engine: LoadedEngine | None = None
        self.parsing = OutputParsing(None, False)
        self.started = int(time.time())

    def start_engine(self, load: Callable[[], LoadedEngine]) -> EngineLoop:
        """Load the models and prove them with a 1-token generation (runs on the worker)."""
        engine = load()
        warm_up_ids = engine.tokenizer.encode("Hello") or [0]
        cfg = GenerationConfig(
            method=self.config.default_method,
            budget=self.config.default_budget,
            max_new_tokens=1,
            temperature=0.0,
            cache_prompt=False,  # the warm-up leaves the prefix cache empty
        )
        loop = engine.scheduler or SerialLoop(engine.generate)
        result = _run_alone(loop, warm_up_ids, cfg)
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
        loop.on_pass = self.metrics.observe_pass
        loop.on_preempt = self.metrics.preemptions.inc
        return loop

    def begin_shutdown(self) -> None:
        """The server is stopping (engine/server/shutdown.py): requests running or waiting get
        `shutdown_grace_s` to finish, then the worker cuts them (each answered 503)."""
        grace = self.config.shutdown_grace_s
        log.info("shutting down: requests in flight get %g s to finish, then a 503", grace)
        asyncio.get_running_loop().call_later(grace, self.worker.cut)

    # -- what every request needs -----------------------------------------------------------

    async def require_api_key(self, request: Request) -> None:
        expected = self.config.api_key
        if not expected:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            given.strip().encode(), expected.encode()
        ):
            raise ApiError(401, "invalid or missing API key", code="invalid_api_key")

    async def prepare(self, prepare: Callable[[bytes], Any], request: Request) -> Any:
        """Read the body within the size limit, then run `prepare(raw)` off the event loop."""
        raw = await read_body(request, self.config.max_request_bytes)
        return await asyncio.get_running_loop().run_in_executor(self.prepare_pool, prepare, raw)

    def ready_engine(self) -> LoadedEngine:
        if self.engine is None or not self.worker.ready.is_set():
            why = self.worker.startup_error or "the model is still loading"
            raise ApiError(503, f"engine not ready: {why}", kind="server_error", code="not_ready")
        return self.engine

    def check_model(self, model: str | None) -> None:
        """A model this server does not serve is a 404 (as OpenAI and vLLM answer)."""
        if model and model != self.config.model_name:
            raise ApiError(
                404,
                f"model '{model}' is not served here; this server serves '{self.config.model_name}'",
                param="model",
                code="model_not_found",
            )

    # -- errors -----------------------------------------------------------------------------

    async def api_error_response(self, request: Request, exc: ApiError) -> JSONResponse:
        self.count_error(request.url.path, exc.status)
        headers = {"Retry-After": "1"} if exc.status == 503 else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    def count_error(self, endpoint: str, status: int) -> None:
        self.metrics.errors.labels(endpoint, str(status)).inc()
