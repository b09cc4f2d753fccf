"""Request bodies of the engine server: a size limit, enforced while the body arrives.

`read_body(request, max_bytes)` refuses a body whose `Content-Length` is over the limit before
reading any of it, and a body without one (chunked) as soon as what arrived passes the limit:
a 413 ApiError naming the limit. uvicorn pauses reading a connection while the app has not taken
what it buffered, so a refused body is never held in memory whole.

The default limit holds the longest prompt Qwen3.6 takes (262,144 tokens) as JSON text at about
4 characters per token with room for escapes, tools and history; a prompt of token ids costs at
most 7 bytes per id ("248070,").
"""

from __future__ import annotations

from starlette.requests import Request

from engine.server.schemas import ApiError

DEFAULT_MAX_REQUEST_BYTES = 8 * 2**20


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The whole body, or a 413 ApiError once it is known to exceed `max_bytes`."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(max_bytes)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(max_bytes: int) -> ApiError:
    return ApiError(
        413,
        f"request body too large: this server takes at most {max_bytes} bytes "
        "(serve --max-request-bytes)",
        code="request_too_large",
    )
