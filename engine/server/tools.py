"""Tool calls in generated text -> OpenAI `tool_calls`, in the two formats Qwen models write.

- `hermes` (Qwen2.5, Qwen3, the demo pair): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`
- `qwen3_coder` (Qwen3-Coder, Qwen3.5, Qwen3.6): `<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\n
  VALUE\\n</parameter>\\n</function>\\n</tool_call>`, values typed by the tool's JSON schema.

`detect_format(chat_template)` picks the format the model's own template teaches (`serve
--tool-call-parser` overrides it). `ToolCallExtractor` turns streamed content into content text
and whole `ToolCall`s: a call is handed out when its closing tag arrives (or at the end, if it
parses unclosed); a block that does not parse, or names a tool the request did not declare,
goes back into the content verbatim, so malformed output stays visible and is never an error.
Whitespace between a call and the text around it is dropped. An output cut by the token limit
(`finish(cut=True)`) inside a call is still that call, `complete` False, with the arguments
written so far (JSON cut where the output was, as OpenAI sends it): never markup in content.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from engine.server.reasoning import partial_tag_length

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"

# A tool's JSON schema for its arguments, by tool name.
Schemas = Mapping[str, Mapping[str, Any]]


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as OpenAI sends it (cut short when not `complete`)
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])
    complete: bool = True  # False: the token limit cut it

    def as_openai(self) -> dict:
        function = {"name": self.name, "arguments": self.arguments}
        return {"id": self.id, "type": "function", "function": function}


@dataclass(frozen=True)
class ToolCallFormat:
    """How one model family writes a call: parse a block's body, or open a call to force it."""

    name: str
    parse_body: Callable[[str, Schemas], tuple[str, dict] | None]
    opening: Callable[[str | None], str]  # tool name (or None: any tool) -> the call's start
    # a cut body -> (the name so far, the arguments so far)
    parse_cut: Callable[[str, Schemas], tuple[str, str]]


def _parse_hermes(body: str, schemas: Schemas) -> tuple[str, dict] | None:
    try:
        call = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    return (call["name"], arguments) if isinstance(arguments, dict) else None


_HERMES_CUT = re.compile(
    r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)(?:"\s*(?:,\s*"arguments"\s*:\s*(.*))?)?', re.DOTALL
)


def _parse_hermes_cut(body: str, schemas: Schemas) -> tuple[str, str]:
    cut = _HERMES_CUT.match(body)
    if cut is None:
        return "", ""
    return cut[1], (cut[2] or "").rstrip()


def _hermes_opening(name: str | None) -> str:
    start = CALL_OPEN + '\n{"name": '
    return start + '"' if name is None else start + json.dumps(name) + ', "arguments": '


_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*)</function>\s*", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


def _parse_qwen3_coder(body: str, schemas: Schemas) -> tuple[str, dict] | None:
    function = _FUNCTION.fullmatch(body)
    if function is None:
        return None
    name, inner = function[1].strip(), function[2]
    properties = schemas.get(name, {}).get("properties", {})
    arguments, position = {}, 0
    for parameter in _PARAMETER.finditer(inner):
        if inner[position : parameter.start()].strip():
            return None  # text between parameters: not this format
        key = parameter[1].strip()
        arguments[key] = _typed_value(_strip_one_newline(parameter[2]), properties.get(key))
        position = parameter.end()
    return None if inner[position:].strip() else (name, arguments)


_FUNCTION_CUT = re.compile(r"\s*<function=([^>\n]*)>?(.*)", re.DOTALL)
_PARAMETER_CUT = re.compile(r"<parameter=([^>\n]+)>\n?(.*)", re.DOTALL)


def _parse_qwen3_coder_cut(body: str, schemas: Schemas) -> tuple[str, str]:
    """The name and the parameters so far as JSON cut where the output was: the complete
    parameters' values typed by the schema, the open one's text as a string begun."""
    function = _FUNCTION_CUT.match(body)
    if function is None:
        return "", ""
    name, inner = function[1].strip(), function[2]
    properties = schemas.get(name, {}).get("properties", {})
    pieces, position = [], 0
    for parameter in _PARAMETER.finditer(inner):
        key = parameter[1].strip()
        value = _typed_value(_strip_one_newline(parameter[2]), properties.get(key))
        pieces.append(f"{json.dumps(key)}: {json.dumps(value, ensure_ascii=False)}")
        position = parameter.end()
    open_parameter = _PARAMETER_CUT.search(inner, position)
    if open_parameter is not None:
        begun = json.dumps(open_parameter[2], ensure_ascii=False)[:-1]  # a string begun
        pieces.append(f"{json.dumps(open_parameter[1].strip())}: {begun}")
    return name, "{" + ", ".join(pieces) if (pieces or function[2]) else ""


def _strip_one_newline(value: str) -> str:
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def _typed_value(raw: str, schema: Any) -> Any:
    """A parameter's text as its schema's type: strings stay text, the rest is read as JSON."""
    kinds = schema.get("type") if isinstance(schema, Mapping) else None
    kinds = set(kinds) if isinstance(kinds, list) else {kinds}
    if "string" in kinds or kinds == {None}:
        return raw
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def _qwen3_coder_opening(name: str | None) -> str:
    return CALL_OPEN + "\n<function=" + ("" if name is None else name + ">\n")


FORMATS = {
    "hermes": ToolCallFormat("hermes", _parse_hermes, _hermes_opening, _parse_hermes_cut),
    "qwen3_coder": ToolCallFormat(
        "qwen3_coder", _parse_qwen3_coder, _qwen3_coder_opening, _parse_qwen3_coder_cut
    ),
}
# `serve --tool-call-parser`: "auto" follows the chat template.
TOOL_CALL_PARSERS = ("auto", "none", *FORMATS)


def detect_format(chat_template: str | None) -> ToolCallFormat | None:
    """The format a chat template teaches its model, or None if it teaches no tool calls."""
    template = chat_template or ""
    if "<function=" in template:
        return FORMATS["qwen3_coder"]
    if CALL_OPEN in template:
        return FORMATS["hermes"]
    return None


class ToolCallExtractor:
    """Content text -> content deltas (str) and ToolCalls, as the text streams in."""

    def __init__(self, format: ToolCallFormat, schemas: Schemas) -> None:
        self._format = format
        self._schemas = schemas
        self._buffer = ""
        self._in_call = False
        self._held_space = ""  # trailing whitespace: dropped if a call follows
        self._space_before_call = ""  # restored if the call turns out malformed
        self._after_call = False  # leading whitespace after a call is dropped

    def feed(self, text: str) -> list[str | ToolCall]:
        self._buffer += text
        out: list[str | ToolCall] = []
        while self._step(out):
            pass
        return out

    def finish(self, cut: bool = False) -> list[str | ToolCall]:
        """What is left; `cut`: the token limit ended the output (a call begun is a call)."""
        out: list[str | ToolCall] = []
        if self._in_call and cut:
            self._in_call = False
            self._cut_call(self._buffer, out)
        elif self._in_call:  # never closed: a call only if what there is parses
            self._in_call = False
            self._close_call(self._buffer, out, closed=False)
        elif not (cut and self._buffer and CALL_OPEN.startswith(self._buffer)):
            self._content(self._buffer, out)  # (a cut opening tag is no content)
        self._buffer = ""
        if self._held_space and not self._after_call:
            out.append(self._held_space)
        self._held_space = ""
        return out

    def _step(self, out: list[str | ToolCall]) -> bool:
        """Consume what can be decided now; True while there may be more."""
        if self._in_call:
            end = self._buffer.find(CALL_CLOSE)
            if end < 0:
                return False
            body, self._buffer = self._buffer[:end], self._buffer[end + len(CALL_CLOSE) :]
            self._in_call = False
            self._close_call(body, out, closed=True)
            return True
        start = self._buffer.find(CALL_OPEN)
        if start >= 0:
            self._content(self._buffer[:start], out)
            self._space_before_call, self._held_space = self._held_space, ""
            self._buffer = self._buffer[start + len(CALL_OPEN) :]
            self._in_call = True
            return True
        keep = partial_tag_length(self._buffer, CALL_OPEN)
        self._content(self._buffer[: len(self._buffer) - keep], out)
        self._buffer = self._buffer[len(self._buffer) - keep :]
        return False

    def _close_call(self, body: str, out: list[str | ToolCall], *, closed: bool) -> None:
        parsed = self._format.parse_body(body, self._schemas)
        if parsed is not None and (not self._schemas or parsed[0] in self._schemas):
            name, arguments = parsed
            out.append(ToolCall(name, json.dumps(arguments, ensure_ascii=False)))
            self._after_call, self._space_before_call = True, ""
            return
        block = CALL_OPEN + body + (CALL_CLOSE if closed else "")
        self._held_space, self._space_before_call = self._space_before_call, ""
        self._content(block, out)

    def _cut_call(self, body: str, out: list[str | ToolCall]) -> None:
        """A call the token limit cut: its name (the one declared tool it begins, if only one
        does) and its arguments so far; nothing when not even a name was begun."""
        whole = self._format.parse_body(body, self._schemas)
        if whole is not None and whole[0] in self._schemas:  # only its closing tag was cut
            out.append(ToolCall(whole[0], json.dumps(whole[1], ensure_ascii=False)))
            self._after_call, self._space_before_call = True, ""
            return
        name, arguments = self._format.parse_cut(body, self._schemas)
        begun = [declared for declared in self._schemas if declared.startswith(name)]
        name = begun[0] if len(begun) == 1 else name
        if name:
            out.append(ToolCall(name, arguments, complete=False))
            self._after_call, self._space_before_call = True, ""

    def _content(self, text: str, out: list[str | ToolCall]) -> None:
        if self._after_call:
            text = text.lstrip()
            self._after_call = not text
        text = self._held_space + text
        stripped = text.rstrip()
        self._held_space = text[len(stripped) :]
        if stripped:
            out.append(stripped)
