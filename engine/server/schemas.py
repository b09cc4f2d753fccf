"""Request bodies of the engine's OpenAI-compatible API, and its error shape.

Bodies are parsed strictly (a string where a number belongs is an error, not a coercion), with
two allowances OpenAI's own schema makes: a JSON null for a field with a default means that
default (OpenAI marks `stream`, `temperature`, `n`, `echo`, ... nullable; a null `prompt` is the
document separator OpenAI defaults it to), and an integral number (`2.0`) is an integer.
`parse_body` turns every parse or validation failure into an `ApiError`, which the server renders
as OpenAI's `{"error": {"message", "type", "param", "code"}}` with status 400: bad input never
becomes a 500.

Fields beyond the ones a request model declares are sorted, as vLLM sorts them:
- a field of OpenAI's API for that endpoint that the server does not implement is refused with
  a 400 naming it, unless its value asks for nothing (null, `suffix: ""`, `store: false`,
  ...) or it only describes the caller (`user`, `metadata`, ...);
- any other field is ignored, with a logged warning naming it.
The same holds inside messages (`function_call`, `audio`, `refusal`).
"""

from __future__ import annotations

import json
import logging
from typing import Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from engine.methods import METHODS

log = logging.getLogger(__name__)

# torch.Generator.manual_seed takes a 64-bit integer; a seed is accepted as a signed one (as vLLM).
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
# What a completion's prompt is when null: OpenAI's default, the document separator.
DOCUMENT_START = "<|endoftext|>"

# Fields of OpenAI's API (openai-python's CompletionCreateParams, chat and legacy).
CHAT_API_FIELDS = frozenset(
    [
        "audio",
        "frequency_penalty",
        "function_call",
        "functions",
        "logit_bias",
        "logprobs",
        "max_completion_tokens",
        "max_tokens",
        "messages",
        "metadata",
        "modalities",
        "model",
        "moderation",
        "n",
        "parallel_tool_calls",
        "prediction",
        "presence_penalty",
        "prompt_cache_key",
        "prompt_cache_options",
        "prompt_cache_retention",
        "reasoning_effort",
        "response_format",
        "safety_identifier",
        "seed",
        "service_tier",
        "stop",
        "store",
        "stream",
        "stream_options",
        "temperature",
        "tool_choice",
        "tools",
        "top_logprobs",
        "top_p",
        "user",
        "verbosity",
        "web_search_options",
    ]
)
COMPLETION_API_FIELDS = frozenset(
    [
        "best_of",
        "echo",
        "frequency_penalty",
        "logit_bias",
        "logprobs",
        "max_tokens",
        "model",
        "n",
        "presence_penalty",
        "prompt",
        "seed",
        "stop",
        "stream",
        "stream_options",
        "suffix",
        "temperature",
        "top_p",
        "user",
    ]
)
MESSAGE_API_FIELDS = frozenset(
    ["audio", "content", "function_call", "name", "refusal", "role", "tool_calls"]
)
# Unimplemented fields accepted at the values that ask for nothing, so ignoring them is exact.
NO_OP_VALUES: dict[str, list[Any]] = {
    "suffix": [""],
    "modalities": [["text"]],
    "store": [False],
}
# Fields that describe the caller or hint at caching, never the output: accepted, unused.
INFORMATIONAL_FIELDS = frozenset(
    [
        "user",
        "metadata",
        "safety_identifier",
        "prompt_cache_key",
        "prompt_cache_options",
        "prompt_cache_retention",
        "service_tier",
    ]
)


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


def _refused(param: str, why: str) -> ApiError:
    """A 400 naming `param`, raised from a validator (pydantic lets it through as it is)."""
    return ApiError(400, f"{param}: {why}", param=param)


def _integral(value: Any) -> Any:
    """`2.0` -> 2: JSON Schema's integer is any number without a fraction (so is OpenAI's)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


Integer = Annotated[int, BeforeValidator(_integral)]


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_takes_the_default(cls, data: Any) -> Any:
        """A JSON null for a field with a (non-null) default means that default."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {
            name: value
            for name, value in data.items()
            if value is not None
            or name not in fields
            or fields[name].is_required()
            or fields[name].default is None
        }


class _Request(_Body):
    """A request body: extra fields are kept, then refused or warned about (`parse_body`)."""

    model_config = ConfigDict(strict=True, extra="allow")
    api_fields: ClassVar[frozenset[str]] = frozenset()  # empty: extras are silently ignored


class Speculative(_Body):
    """Per-request decoding choice; fields left out take the server's defaults."""

    method: Literal[METHODS] | None = None  # type: ignore[valid-type]  # the tuple unpacks
    budget: Integer | None = Field(None, ge=1, le=1024)


class StreamOptions(_Body):
    include_usage: bool = False


class JsonSchemaFormat(_Body):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    """`response_format`: text, any JSON object, or JSON valid against a schema
    (engine/server/structured.py constrains the output to it)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type 'json_schema', and only with it")
        return self


class _Sampling(_Request):
    """Fields shared by completions and chat completions. Beyond OpenAI's: vLLM's `top_k`
    (-1 or 0: off), `min_p` and `repetition_penalty` (engine/sampling.py defines them all)."""

    model: str | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, ge=0.0, le=1.0)  # 0: the most likely token alone (greedy)
    top_k: Integer = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=2.0)
    logit_bias: dict[str, float] | None = None  # token id (a string) -> -100..100
    response_format: ResponseFormat | None = None
    seed: Integer | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = Field(None, max_length=4)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Integer = Field(1, ge=1, le=128)  # sequences from the one prompt
    speculative: Speculative | None = None
    cache_prompt: bool = True  # llama.cpp's name: false neither reuses nor extends the prefix cache

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]

    @field_validator("logit_bias")
    @classmethod
    def _bias_by_token_id(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for token, value in (bias or {}).items():
            if not token.isdigit() or not -100 <= value <= 100:
                raise _refused("logit_bias", f"token ids -> -100..100, not {token!r}: {value}")
        return bias

    def sequences(self) -> int:
        """How many sequences to generate (completions' best_of may ask for more than n)."""
        return self.n

    def output_logprobs(self) -> int | None:
        """Alternatives per output token's logprob (None: logprobs not asked)."""
        return None

    def prompt_logprobs(self) -> int | None:
        """Alternatives per prompt token's logprob (None: none)."""
        return None

    def include_usage_chunk(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Sampling):
    """`POST /v1/completions`: a prompt as text or as token ids."""

    api_fields: ClassVar[frozenset[str]] = COMPLETION_API_FIELDS

    prompt: str | list[Integer] | None = Field(min_length=1)
    max_tokens: Integer | None = Field(16, ge=0)  # 0: the prompt alone (echo, its logprobs)
    echo: bool = False  # the prompt before the output (and its logprobs, with logprobs)
    logprobs: Integer | None = Field(None, ge=0, le=5)  # the legacy API's: alternatives per token
    best_of: Integer | None = Field(None, ge=0, le=20)  # sequences made (0, None: n); best n back

    @model_validator(mode="after")
    def _best_of_at_least_n(self) -> CompletionRequest:
        if self.best_of and self.best_of < self.n:
            raise _refused("best_of", f"must be >= n ({self.n}), not {self.best_of}")
        if self.stream and self.sequences() > self.n:
            raise _refused("best_of", "> n cannot be streamed (only the best n are returned)")
        if self.stream and self.echo and self.logprobs is not None:
            raise _refused("echo", "with logprobs is not streamed (the prompt's come at the end)")
        return self

    def sequences(self) -> int:
        return self.best_of or self.n

    def output_logprobs(self) -> int | None:
        return self.logprobs

    def prompt_logprobs(self) -> int | None:
        return self.logprobs if self.echo else None

    @field_validator("prompt")
    @classmethod
    def _null_prompt_starts_a_document(cls, prompt: str | list[int] | None) -> str | list[int]:
        return DOCUMENT_START if prompt is None else prompt

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens


class TextPart(_Body):
    type: Literal["text"]
    text: str


class CalledFunction(_Body):
    name: str
    arguments: str | dict[str, Any]  # OpenAI sends a JSON string; templates' own callers, objects


class AssistantToolCall(_Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class Message(_Body):
    model_config = ConfigDict(strict=True, extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[AssistantToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None  # an earlier turn's reasoning (vLLM, transformers)
    reasoning: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class FunctionDefinition(_Body):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class ChosenFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: ChosenFunction


class ChatTemplateInputs(_Request):
    """What the chat template renders: shared by chat completions and /tokenize."""

    messages: list[Message] = Field(min_length=1)
    # Kept as the client sent them (key order included): templates render them with tojson.
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    documents: list[dict[str, Any]] | None = None  # for templates with a documents block
    chat_template_kwargs: dict[str, Any] | None = None  # e.g. {"enable_thinking": false}

    @field_validator("tools")
    @classmethod
    def _tools_are_functions(cls, tools: list[dict[str, Any]] | None):
        for index, tool in enumerate(tools or []):
            try:
                ToolDefinition.model_validate(tool)
            except ValidationError as exc:
                first = exc.errors(include_url=False)[0]
                where = ".".join(str(p) for p in (index, *first["loc"]))
                raise ValueError(f"tools.{where}: {first['msg']}") from None
        return tools


class ChatRequest(ChatTemplateInputs, _Sampling):
    """`POST /v1/chat/completions`: messages rendered with the model directory's chat template."""

    api_fields: ClassVar[frozenset[str]] = CHAT_API_FIELDS
    max_tokens: Integer | None = Field(None, ge=1)
    max_completion_tokens: Integer | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Integer = Field(0, ge=0, le=20)

    @model_validator(mode="after")
    def _top_logprobs_with_logprobs(self) -> ChatRequest:
        if self.top_logprobs and not self.logprobs:
            raise _refused("top_logprobs", "needs logprobs: true")
        return self

    def output_logprobs(self) -> int | None:
        return self.top_logprobs if self.logprobs else None

    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens


class TokenizeRequest(_Request):
    """`POST /tokenize`: exactly one of `prompt` (raw text) or `messages` (rendered like a chat
    request: the same body, tools and template kwargs included, gives the same ids)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[Any] | None = None  # parsed as ChatTemplateInputs when given


BodyT = TypeVar("BodyT", bound=BaseModel)


def parse_body(schema: type[BodyT], raw: bytes) -> BodyT:
    """Parse a JSON body into `schema`, or raise a 400 ApiError naming the first bad field."""
    try:
        body = schema.model_validate_json(raw or b"")
    except ValidationError as exc:
        raise _api_error(exc) from None
    ignored = sort_extra_fields(body.model_extra or {}, getattr(schema, "api_fields", None), "")
    for index, message in enumerate(getattr(body, "messages", None) or []):
        if isinstance(message, Message):
            ignored += sort_extra_fields(
                message.model_extra or {}, MESSAGE_API_FIELDS, f"messages.{index}."
            )
    if ignored and getattr(schema, "api_fields", None):
        log.warning("ignoring request fields outside the OpenAI API: %s", ", ".join(ignored))
    return body


def parse_part(schema: type[BodyT], value: Any, where: str) -> BodyT:
    """Validate one part of a body (already parsed JSON) found at `where`, or raise a 400."""
    try:
        return schema.model_validate(value)
    except ValidationError as exc:
        raise _api_error(exc, where) from None


class _Informational(_Body):
    """The informational fields' types, as the spec gives them: unused, but a Response echoes
    some (`user`, `metadata`), so a value of the wrong type is a 400 like any other."""

    user: str | None = None
    metadata: dict[str, str] | None = None
    safety_identifier: str | None = Field(None, max_length=64)
    prompt_cache_key: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    service_tier: str | None = None


def sort_extra_fields(
    extra: dict[str, Any],
    api_fields: frozenset[str] | None,
    where: str,
    no_op_values: dict[str, list[Any]] = NO_OP_VALUES,
    informational: frozenset[str] = INFORMATIONAL_FIELDS,
) -> list[str]:
    """Refuse unimplemented API fields (400); return the names of the others, to warn about."""
    ignored = []
    for name, value in extra.items():
        if not api_fields or name not in api_fields:
            ignored.append(where + name)
        elif name in informational:
            parse_part(_Informational, {name: value}, where)
        elif value is not None:
            accepted = no_op_values.get(name)
            if accepted is None or value not in accepted:
                only = f" (only {json.dumps(accepted[0])} is accepted)" if accepted else ""
                raise ApiError(
                    400,
                    f"'{where}{name}' is not implemented by this server{only}",
                    param=where + name,
                    code="unsupported_parameter",
                )
    return ignored


def _api_error(exc: ValidationError, where: str = "") -> ApiError:
    first = exc.errors(include_url=False)[0]
    if first["type"] == "json_invalid":
        return ApiError(400, f"invalid JSON body: {first['msg']}", code="invalid_json")
    if first["type"] == "model_type" and not first["loc"]:
        return ApiError(400, "the request body must be a JSON object", code="invalid_json")
    # Union members appear in loc by their type name ("str", "list[int]"): drop them.
    loc = [str(p) for p in first["loc"] if isinstance(p, int) or not _is_type_name(str(p))]
    param = ".".join([where] * bool(where) + loc) or None
    return ApiError(400, f"{param}: {first['msg']}" if param else first["msg"], param=param)


def _is_type_name(part: str) -> bool:
    return part in {"str", "int", "float", "bool"} or "[" in part
