"""Request bodies of the engine's OpenAI-compatible API, and its error shape.

Bodies are parsed strictly (a string where a number belongs is an error, not a coercion) and
unknown fields are ignored, as OpenAI clients send many optional ones. `parse_body` turns every
parse or validation failure into an `ApiError`, which the server renders as OpenAI's
`{"error": {"message", "type", "param", "code"}}` with status 400: bad input never becomes a 500.
"""

from __future__ import annotations

from typing import Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

METHODS = ("ar", "linear", "ddtree")


class ApiError(Exception):
    """A request the server refuses, with the HTTP status and OpenAI error fields to send."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        kind: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class Speculative(_Body):
    """Per-request decoding choice; fields left out take the server's defaults."""

    method: Literal["ar", "linear", "ddtree"] | None = None
    budget: int | None = Field(None, ge=1, le=1024)


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    seed: int | None = None
    stop: str | list[str] | None = Field(None, max_length=4)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=1)
    speculative: Speculative | None = None

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]

    def include_usage_chunk(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Sampling):
    """`POST /v1/completions`: a prompt as text or as token ids."""

    prompt: str | list[int] = Field(min_length=1)
    max_tokens: int | None = Field(16, ge=1)
    echo: Literal[False] = False

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens


class TextPart(_Body):
    type: Literal["text"]
    text: str


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatRequest(_Sampling):
    """`POST /v1/chat/completions`: messages rendered with the model directory's chat template."""

    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens


class TokenizeRequest(_Body):
    """`POST /tokenize`: exactly one of `prompt` (raw text) or `messages` (chat template applied)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None


BodyT = TypeVar("BodyT", bound=BaseModel)


def parse_body(schema: type[BodyT], raw: bytes) -> BodyT:
    """Parse a JSON body into `schema`, or raise a 400 ApiError naming the first bad field."""
    try:
        return schema.model_validate_json(raw or b"")
    except ValidationError as exc:
        raise _api_error(exc) from None


def _api_error(exc: ValidationError) -> ApiError:
    first = exc.errors(include_url=False)[0]
    if first["type"] == "json_invalid":
        return ApiError(400, f"invalid JSON body: {first['msg']}", code="invalid_json")
    if first["type"] == "model_type" and not first["loc"]:
        return ApiError(400, "the request body must be a JSON object", code="invalid_json")
    # Union members appear in loc by their type name ("str", "list[int]"): drop them.
    loc = [str(p) for p in first["loc"] if isinstance(p, int) or not _is_type_name(str(p))]
    param = ".".join(loc) or None
    return ApiError(400, f"{param}: {first['msg']}" if param else first["msg"], param=param)


def _is_type_name(part: str) -> bool:
    return part in {"str", "int", "float", "bool"} or "[" in part
