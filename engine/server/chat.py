"""Chat completions for agents: OpenAI messages and tools -> the prompt; output -> message fields.

`build_chat_prompt` renders a request with the model's own chat template (engine/chat_template.py):
assistant `tool_calls` (their JSON `arguments` read into objects, as templates expect), `tool`
messages, `tools`, `documents` and `chat_template_kwargs` (e.g. `enable_thinking`). It refuses, as
a 400, what the template or the server cannot honour instead of dropping it: tools for a template
that never renders them, a tool choice with no parser for the model's call format, a named tool
that was not declared.

`tool_choice`: `auto` (the default with tools) parses calls from the output; `none` renders the
tools (as vLLM does) but parses nothing; `required` and a named function end the prompt with the
opening of a call (any tool, or that one), so the output is that call's rest, which the grammar
of engine/server/structured.py constrains (a declared name, arguments valid against its schema),
as it constrains the calls of `auto` when a tool is `strict`. A prompt left inside a think block
is closed first, here and for structured output (`response_format`), which the grammar writes
from the first token. `parallel_tool_calls: false` keeps the first call only.

`ChatOutput` turns the generated text, as it streams, into `reasoning_content`, `content` and
`tool_calls` deltas (engine/server/reasoning.py, engine/server/tools.py); the non-streamed
message is built from the same deltas, so both agree.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any, Protocol

from engine.chat_template import RESERVED_VARIABLES, ChatTemplateError, template_variables
from engine.server.reasoning import CLOSE_OPEN_BLOCK, ReasoningSplitter, prompt_opens_reasoning
from engine.server.schemas import ApiError, ChatTemplateInputs, Message
from engine.server.tools import Schemas, ToolCall, ToolCallExtractor, ToolCallFormat

log = logging.getLogger(__name__)


class ChatRenderer(Protocol):
    """What this needs from the tokenizer (engine.tokenizer.Tokenizer)."""

    chat_template: str | None

    def render_chat(
        self, messages: list[dict], add_generation_prompt: bool = True, **kw
    ) -> str: ...


@dataclass(frozen=True)
class OutputParsing:
    """The server's parsers for the model's output (None: that parsing is off)."""

    tool_format: ToolCallFormat | None
    reasoning: bool


@dataclass(frozen=True)
class ChatPrompt:
    text: str  # the prompt, forced call opening included
    opening: str  # the start of a forced call ("" if none): the output continues it
    tool_format: ToolCallFormat | None  # None: tool calls are not parsed
    schemas: Schemas
    starts_in_reasoning: bool | None  # None: reasoning is not parsed
    max_calls: int | None
    forced: str | None = None  # "required", or the named tool's name
    strict_tools: tuple[str, ...] = ()  # tools declared with strict: true
    history: str | None = None  # with_history: the messages alone (what a next turn re-renders)


def build_chat_prompt(
    body: ChatTemplateInputs,
    renderer: ChatRenderer,
    parsing: OutputParsing,
    structured: bool = False,
    with_history: bool = False,
) -> ChatPrompt:
    """Render the request's conversation, or raise a 400 ApiError saying what cannot be honoured.
    `structured`: the output is grammar-constrained JSON, so no think block is left open;
    `with_history`: also render it without the generation prompt (`ChatPrompt.history`)."""
    template = renderer.chat_template or ""
    variables = template_variables(template) if template else frozenset()
    messages = [_template_message(i, m, template) for i, m in enumerate(body.messages)]
    choice, forced_tool = _tool_choice(body)
    if body.tools and "tools" not in variables:
        raise ApiError(400, "this model's chat template does not render tools", param="tools")
    if body.documents and "documents" not in variables:
        raise ApiError(
            400, "this model's chat template does not render documents", param="documents"
        )
    parse_tools = choice != "none"
    if parse_tools and parsing.tool_format is None:
        raise ApiError(
            400,
            f"tool_choice '{forced_tool or choice}' needs a tool-call parser, and none matches this model's chat "
            "template; start serve with --tool-call-parser",
            param="tool_choice",
        )
    kwargs = _template_kwargs(body, variables)
    try:
        renderings = [
            renderer.render_chat(
                messages, opens, tools=body.tools, documents=body.documents, **kwargs
            )
            for opens in ((True, False) if with_history else (True,))
        ]
    except (ChatTemplateError, ValueError) as exc:
        raise ApiError(400, f"messages: {exc}", param="messages") from None
    text, history = renderings[0], (renderings[1] if with_history else None)
    opening = ""
    forced = choice in ("required", "named")
    if (forced or structured) and prompt_opens_reasoning(text):
        text += CLOSE_OPEN_BLOCK
    if forced:
        opening = parsing.tool_format.opening(forced_tool)
    reasoning = prompt_opens_reasoning(text) if parsing.reasoning else None
    return ChatPrompt(
        text=text + opening,
        history=history,
        opening=opening,
        tool_format=parsing.tool_format if parse_tools else None,
        schemas=_schemas(body.tools or []),
        starts_in_reasoning=reasoning,
        max_calls=None if body.parallel_tool_calls is not False else 1,
        forced=(forced_tool or choice) if forced else None,
        strict_tools=tuple(
            t["function"]["name"] for t in body.tools or [] if t["function"].get("strict")
        ),
    )


def _tool_choice(body: ChatTemplateInputs) -> tuple[str, str | None]:
    """('auto' | 'none' | 'required', None) or ('named', the one tool to call)."""
    choice = body.tool_choice
    if choice is None:
        return ("auto" if body.tools else "none"), None
    names = [tool["function"]["name"] for tool in body.tools or []]
    if choice != "none" and not names:
        raise ApiError(400, "tool_choice needs a non-empty 'tools' list", param="tool_choice")
    if isinstance(choice, str):
        return choice, None
    name = choice.function.name
    if name not in names:
        raise ApiError(
            400, f"tool_choice names '{name}', which is not in tools", param="tool_choice"
        )
    return "named", name


def _template_message(index: int, message: Message, template: str) -> dict[str, Any]:
    where = f"messages.{index}"
    if message.content is None and not (message.role == "assistant" and message.tool_calls):
        raise ApiError(400, f"{where}.content is required", param=f"{where}.content")
    if message.role == "tool" and not message.tool_call_id:
        raise ApiError(400, f"{where}.tool_call_id is required", param=f"{where}.tool_call_id")
    # Qwen's templates know no "developer" role (OpenAI's new name for system) and would drop it.
    role = "system" if message.role == "developer" and "developer" not in template else message.role
    reasoning = message.reasoning_content
    return {
        "role": role,
        "content": None if message.content is None else message.text(),
        "name": message.name,
        "reasoning_content": message.reasoning if reasoning is None else reasoning,
        "tool_calls": [
            _template_call(f"{where}.tool_calls.{i}", call)
            for i, call in enumerate(message.tool_calls)
        ]
        if message.tool_calls
        else None,
        "tool_call_id": message.tool_call_id,
    }


def _template_call(where: str, call) -> dict[str, Any]:
    """An assistant's tool call with its arguments as an object, as chat templates read them."""
    arguments = call.function.arguments
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as exc:
            raise ApiError(
                400, f"{where}.function.arguments is not JSON: {exc}", param=where
            ) from None
    if not isinstance(arguments, dict):
        raise ApiError(400, f"{where}.function.arguments must be a JSON object", param=where)
    function = {"name": call.function.name, "arguments": arguments}
    return {"id": call.id, "type": "function", "function": function}


def _template_kwargs(body: ChatTemplateInputs, variables: frozenset[str]) -> dict[str, Any]:
    kwargs = dict(body.chat_template_kwargs or {})
    if clash := sorted(RESERVED_VARIABLES & kwargs.keys()):
        raise ApiError(
            400, f"chat_template_kwargs may not set {clash}", param="chat_template_kwargs"
        )
    if unused := sorted(kwargs.keys() - variables):
        log.warning("chat_template_kwargs the chat template does not read: %s", ", ".join(unused))
    return kwargs


def _schemas(tools: list[dict]) -> dict[str, dict]:
    return {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools}


class ChatOutput:
    """Generated text -> chat deltas: {"reasoning_content"}, {"content"} and {"tool_calls"}."""

    def __init__(self, prompt: ChatPrompt) -> None:
        starts = prompt.starts_in_reasoning
        self._reasoning = None if starts is None else ReasoningSplitter(starts)
        self._tools = None
        if prompt.tool_format is not None:
            self._tools = ToolCallExtractor(prompt.tool_format, prompt.schemas)
        self._max_calls = prompt.max_calls
        self.calls: list[ToolCall] = []
        self._pending = prompt.opening  # the forced opening is the output's own beginning

    def feed(self, text: str) -> list[dict]:
        return self._route(*self._split(text, final=False), final=False)

    def finish(self, cut: bool = False) -> list[dict]:
        """The last deltas; `cut`: the token limit ended the output (a call begun stays a
        call, engine/server/tools.py)."""
        return self._route(*self._split("", final=True), final=True, cut=cut)

    def message(self, deltas: list[dict]) -> dict:
        """The non-streamed message from all of one generation's deltas."""
        content = "".join(d.get("content", "") for d in deltas)
        reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
        message: dict[str, Any] = {"role": "assistant", "content": content or None, "refusal": None}
        if not self.calls:
            message["content"] = content
        if reasoning:
            message["reasoning_content"] = reasoning
        if self.calls:
            message["tool_calls"] = [call.as_openai() for call in self.calls]
        return message

    def _split(self, text: str, *, final: bool) -> tuple[str, str]:
        if self._reasoning is None:
            return "", text
        return self._reasoning.finish() if final else self._reasoning.feed(text)

    def _route(self, reasoning: str, content: str, *, final: bool, cut: bool = False) -> list[dict]:
        deltas = [{"reasoning_content": reasoning}] if reasoning else []
        if self._tools is None:
            return deltas + ([{"content": content}] if content else [])
        content, self._pending = self._pending + content, ""
        pieces = self._tools.feed(content) + (self._tools.finish(cut) if final else [])
        for piece in pieces:
            if isinstance(piece, str):
                deltas.append({"content": piece})
            elif self._max_calls is None or len(self.calls) < self._max_calls:
                deltas.append({"tool_calls": [{"index": len(self.calls), **piece.as_openai()}]})
                self.calls.append(piece)
        return deltas
