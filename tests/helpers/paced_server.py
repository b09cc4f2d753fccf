"""An OpenAI-compatible completions server at a fixed pace, for checking a bench's counting
against another tool's (issue 37, Must 5): every streamed completion waits TTFT_MS before its
first token and ITL_MS between tokens (asyncio sleeps, so the engine's speed is out of it and
what is left is each client's counting), one token a chunk, usage at the end. It answers what
`ddops bench --url` asks (/ready, /v1/models with max_model_len, /tokenize, /metrics). A dev
tool, not shipped.

    python -m tests.helpers.paced_server PORT TTFT_MS ITL_MS
    ddops bench --url http://127.0.0.1:PORT --methods default --lengths 32 --concurrency 4 ...
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

MAX_MODEL_LEN = 2048


def app(ttft_s: float, itl_s: float) -> Starlette:
    async def models(request: Request) -> JSONResponse:
        card = {"id": "paced", "object": "model", "max_model_len": MAX_MODEL_LEN}
        return JSONResponse({"object": "list", "data": [card]})

    async def ready(request: Request) -> JSONResponse:
        return JSONResponse({"status": "ready"})

    async def tokenize(request: Request) -> JSONResponse:
        return JSONResponse({"count": len(str((await request.json()).get("prompt", "")).split())})

    async def metrics(request: Request) -> PlainTextResponse:
        return PlainTextResponse(f"process_cpu_seconds_total {time.process_time()}\n")

    async def completions(request: Request) -> StreamingResponse:
        body = await request.json()
        tokens, prompt_tokens = int(body.get("max_tokens") or 16), len(str(body["prompt"]).split())
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "model": "paced"}

        def event(choices: list, **more) -> str:
            return f"data: {json.dumps({**head, 'choices': choices, **more})}\n\n"

        async def events():
            await asyncio.sleep(ttft_s)
            for i in range(tokens):
                if i:
                    await asyncio.sleep(itl_s)
                yield event([{"index": 0, "text": f" w{i}", "finish_reason": None}])
            yield event([{"index": 0, "text": "", "finish_reason": "length"}])
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": tokens,
                     "total_tokens": prompt_tokens + tokens}  # fmt: skip
            yield event([], usage=usage)
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    routes = [Route("/v1/models", models), Route("/ready", ready), Route("/metrics", metrics),
              Route("/tokenize", tokenize, methods=["POST"]),
              Route("/v1/completions", completions, methods=["POST"])]  # fmt: skip
    return Starlette(routes=routes)


def main(argv: list[str]) -> None:
    port, ttft_ms, itl_ms = int(argv[0]), float(argv[1]), float(argv[2])
    uvicorn.run(
        app(ttft_ms / 1000, itl_ms / 1000), host="127.0.0.1", port=port, log_level="warning"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
