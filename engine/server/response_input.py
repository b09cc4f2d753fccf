"""A Responses API request (`POST /v1/responses`) read as the chat completion it asks for.

The Responses API is served by chat completions' own path (engine/server/responses.py), so this
module only translates a request into a chat body:

- `instructions` -> a leading system message; `input` (a string, or items) -> messages: message
  items as they are, a run of assistant items (`reasoning`, an assistant `message`,
  `function_call`s) -> one assistant message with `reasoning_content`, `content` and
  `tool_calls`, `function_call_output` -> a `tool` message;
- function `tools` (flat: name, description, parameters, strict) -> chat's nested ones;
  `tool_choice` likewise; `text.format` -> `response_format`, `text.verbosity` -> `verbosity`,
  `reasoning.effort` -> `reasoning_effort`, `max_output_tokens` -> `max_completion_tokens`;
- every other field (temperature, top_p, seed, stop, speculative, chat_template_kwargs, ...)
  as chat reads it: implemented, refused with a 400 naming it, or ignored with a warning.

`input` may be left out: `instructions` alone are the whole conversation, and with neither the
request is an empty user turn (as `input: ""`).
`include: ["message.output_text.logprobs"]` -> chat's `logprobs: true` (with `top_logprobs` as
given). The Responses API's own fields that need stored state (`previous_response_id`,
`conversation`, `prompt`), background runs, `truncation: "auto"`, other `include`s, hosted tools
and non-text inputs are refused with a 400 naming them; `store` is accepted and nothing is
stored. A chat error's
`param` is given back under the Responses name (`response_format` -> `text.format`, ...).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field

from engine.server.schemas import (
    ApiError,
    ChatRequest,
    FunctionDefinition,
    Integer,
    _Body,
    _Request,
    parse_body,
    parse_part,
    sort_extra_fields,
)

# Fields of the Responses API that chat completions does not share: read here, not forwarded.
RESPONSES_ONLY_FIELDS = frozenset(
    [
        "background",
        "context_management",
        "conversation",
        "include",
        "max_tool_calls",
        "previous_response_id",
        "prompt",
        "store",
        "stream_options",
        "truncation",
    ]
)
LOGPROBS_INCLUDE = "message.output_text.logprobs"
_NO_OP_VALUES: dict[str, list[Any]] = {
    "background": [False],
    "include": [[], [LOGPROBS_INCLUDE]],  # the logprobs are chat's `logprobs`
    "truncation": ["disabled"],
}
# store: nothing is kept either way; stream_options: only obfuscation padding; max_tool_calls:
# a limit on hosted tools, of which there are none.
_INFORMATIONAL = frozenset(["store", "stream_options", "max_tool_calls"])
# Chat fields the translation sets: a Responses request naming them is outside its API.
_SET_BY_TRANSLATION = frozenset(
    [
        "messages",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "response_format",
        "verbosity",
        "reasoning_effort",
        "max_tokens",
        "max_completion_tokens",
        "stream",
        "functions",
        "function_call",
        "logprobs",  # from `include`
        "n",  # a response is one output
    ]
)
_RESPONSES_NAMES = {
    "response_format": "text.format",
    "verbosity": "text.verbosity",
    "reasoning_effort": "reasoning.effort",
    "max_completion_tokens": "max_output_tokens",
    "messages": "input",
}


class TextConfig(_Body):
    format: dict[str, Any] | None = None
    verbosity: str | None = None


class ReasoningConfig(_Body):
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class FunctionChoice(_Body):
    type: Literal["function"]
    name: str


class ResponsesRequest(_Request):
    """The fields translated here; the others stay extras (`model_extra`)."""

    model: str | None = None
    input: str | list[dict[str, Any]] | None = None  # None: the instructions alone
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: Integer | None = Field(None, ge=1)
    top_logprobs: Integer | None = Field(None, ge=0, le=20)  # shown only with the include
    stream: bool = False


# -- input items -------------------------------------------------------------------------------


class ContentPart(_Body):
    type: str
    text: str | None = None
    refusal: str | None = None


class MessageItem(_Body):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]


class FunctionCallItem(_Body):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(_Body):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[ContentPart]


class ReasoningPart(_Body):
    text: str


class ReasoningItem(_Body):
    type: Literal["reasoning"]
    summary: list[ReasoningPart] = []
    content: list[ReasoningPart] | None = None


_ITEMS: dict[str, type[_Body]] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
    "reasoning": ReasoningItem,
}
_TEXT_PARTS = ("input_text", "output_text", "text")


def chat_request(body: ResponsesRequest) -> ChatRequest:
    """The chat completion request `body` asks for, or a 400 ApiError in Responses' terms."""
    try:
        return parse_body(ChatRequest, json.dumps(chat_body(body)).encode())
    except ApiError as exc:
        raise _in_responses_terms(exc) from None


def chat_body(body: ResponsesRequest) -> dict[str, Any]:
    """The chat completion body `body` translates to (checked by `chat_request`)."""
    extra = dict(body.model_extra or {})
    own = {name: extra.pop(name) for name in list(extra) if name in RESPONSES_ONLY_FIELDS}
    sort_extra_fields(own, RESPONSES_ONLY_FIELDS, "", _NO_OP_VALUES, _INFORMATIONAL)
    forwarded = {name: value for name, value in extra.items() if name not in _SET_BY_TRANSLATION}
    chat: dict[str, Any] = {
        **forwarded,
        "model": body.model,
        "messages": _messages(body),
        "max_completion_tokens": body.max_output_tokens,
        "parallel_tool_calls": body.parallel_tool_calls,
    }
    if LOGPROBS_INCLUDE in (own.get("include") or []):
        chat.update(logprobs=True, top_logprobs=body.top_logprobs)
    if body.tools:
        chat["tools"] = [_chat_tool(i, tool) for i, tool in enumerate(body.tools)]
    if body.tool_choice is not None:
        chat["tool_choice"] = _chat_tool_choice(body.tool_choice)
    if body.text is not None:
        chat["verbosity"] = body.text.verbosity
        if body.text.format is not None and body.text.format.get("type") != "text":
            chat["response_format"] = _response_format(body.text.format)
    if body.reasoning is not None:
        chat["reasoning_effort"] = body.reasoning.effort
        if body.reasoning.summary or body.reasoning.generate_summary:
            raise _unsupported("reasoning.summary", "reasoning comes back whole, not summarised")
    return chat


def _messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if body.instructions is not None:
        messages.append({"role": "system", "content": body.instructions})
    given = "" if body.input is None and not messages else body.input  # nothing: an empty turn
    if isinstance(given, str):
        return [*messages, {"role": "user", "content": given}]
    for index, raw in enumerate(body.input or []):
        where = f"input.{index}"
        kind = raw.get("type", "message") if isinstance(raw, dict) else None
        if kind not in _ITEMS:
            raise _unsupported(
                f"{where}.type",
                f"input items of type {json.dumps(kind)} are not supported "
                f"(supported: {', '.join(_ITEMS)})",
            )
        _add_item(messages, parse_part(_ITEMS[kind], raw, where), where)
    for message in messages:  # a turn of reasoning alone still has (empty) content
        if message["role"] == "assistant" and message["content"] is None:
            message["content"] = None if message.get("tool_calls") else ""
    return messages


def _add_item(messages: list[dict[str, Any]], item: _Body, where: str) -> None:
    """Append `item` to the chat messages, joining a run of assistant items into one turn."""
    if isinstance(item, FunctionCallOutputItem):
        output = _text(item.output, f"{where}.output")
        messages.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
    elif isinstance(item, MessageItem) and item.role != "assistant":
        messages.append({"role": item.role, "content": _text(item.content, f"{where}.content")})
    elif isinstance(item, FunctionCallItem):
        call = {"name": item.name, "arguments": item.arguments}
        turn = _assistant_turn(messages, "tool_calls")
        turn.setdefault("tool_calls", []).append(
            {"id": item.call_id, "type": "function", "function": call}
        )
    elif isinstance(item, MessageItem):
        _assistant_turn(messages, "content")["content"] = _text(item.content, f"{where}.content")
    else:
        parts = item.content if item.content else item.summary
        reasoning = "\n".join(part.text for part in parts)
        _assistant_turn(messages, "reasoning_content")["reasoning_content"] = reasoning


# The order of an assistant turn's parts: a part may join the turn only after those it follows.
_TURN_ORDER = ("reasoning_content", "content", "tool_calls")


def _assistant_turn(messages: list[dict[str, Any]], part: str) -> dict[str, Any]:
    """The assistant message `part` joins: the last message if it is the assistant's and has
    neither `part` (calls excepted: a turn makes several) nor a part that comes after it; else
    a new one."""
    last = messages[-1] if messages else None
    blocking = () if part == "tool_calls" else _TURN_ORDER[_TURN_ORDER.index(part) :]
    if last is None or last["role"] != "assistant" or any(last.get(p) for p in blocking):
        last = {"role": "assistant", "content": None}
        messages.append(last)
    return last


def _text(content: str | list, where: str) -> str:
    if isinstance(content, str):
        return content
    pieces = []
    for index, part in enumerate(content):
        if part.type in _TEXT_PARTS and part.text is not None:
            pieces.append(part.text)
        elif part.type == "refusal" and part.refusal is not None:
            pieces.append(part.refusal)
        else:
            raise _unsupported(
                f"{where}.{index}.type",
                f"content of type {json.dumps(part.type)} is not supported (this model reads text)",
            )
    return "".join(pieces)


def _chat_tool(index: int, tool: dict[str, Any]) -> dict[str, Any]:
    """A flat Responses function tool as chat's nested one, its keys in the order chat's clients
    send them (templates render tools with tojson)."""
    where = f"tools.{index}"
    if tool.get("type") != "function":
        raise _unsupported(
            f"{where}.type",
            f"tools of type {json.dumps(tool.get('type'))} are not supported (function tools only)",
        )
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
    parse_part(FunctionDefinition, function, where)
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice
    named = parse_part(FunctionChoice, choice, "tool_choice")
    return {"type": "function", "function": {"name": named.name}}


def _response_format(text_format: dict[str, Any]) -> dict[str, Any]:
    """`text.format` as chat's `response_format` (json_schema's fields nest one level down)."""
    if text_format.get("type") != "json_schema":
        return text_format
    schema = {k: v for k, v in text_format.items() if k != "type"}
    return {"type": "json_schema", "json_schema": schema}


def _in_responses_terms(exc: ApiError) -> ApiError:
    if exc.param is None:
        return exc
    head, _, rest = exc.param.partition(".")
    name = _RESPONSES_NAMES.get(head)
    if name is None:
        return exc
    param = f"{name}.{rest}" if rest and head != "messages" else name
    message = exc.message.replace(f"'{head}'", f"'{name}'").replace(f"{exc.param}:", f"{param}:")
    return ApiError(exc.status, message, kind=exc.kind, param=param, code=exc.code)


def _unsupported(param: str, why: str) -> ApiError:
    return ApiError(400, f"'{param}': {why}", param=param, code="unsupported_parameter")
