"""Structured output: `response_format` and forced tool calls -> the engine's grammar.

The server compiles (it has the tokenizer); the engine follows the grammar inside every
decoding method (engine/grammar.py). What is constrained:

- `response_format` `json_object`: any JSON object; `json_schema`: JSON valid against its
  `schema` (with `strict` true or not: vLLM constrains both, and so does this server). Compact
  JSON, no whitespace between tokens.
- `tool_choice` `required` or a named function: the prompt already ends with the call's opening
  (engine/server/chat.py); the grammar writes the rest in the template's own call format
  (hermes JSON or qwen3_coder's `<function=...>` XML, engine/server/tools.py): the name among
  the declared tools, the arguments valid against that tool's `parameters` schema, the closing
  tag, then the end of the turn. One call, so `tool_calls` always comes back.
- `tool_choice` `auto` with a tool marked `strict: true`: text is free, but a call, once the
  model opens one, follows the format and the called tool's schema (strict or not; a call the
  model opens must parse). With a JSON `response_format` too, the turn is either that JSON (the
  final answer) or calls: what an agent with tools and a typed output asks for.

A forced tool call outranks `response_format` (which shapes a final answer, not a call). A tag
that the tokenizer holds as one special token is written as that token (`<[id]>`), as the model
writes it. Schemas llguidance cannot compile are refused with a 400 naming the field.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

import llguidance

from engine.grammar import COMPACT, Constraint, tokenizer_from_json
from engine.server.chat import ChatPrompt
from engine.server.schemas import ApiError, ResponseFormat
from engine.server.tools import CALL_CLOSE, CALL_OPEN, Schemas, ToolCallFormat

log = logging.getLogger(__name__)

ANY_OBJECT = {"type": "object"}


def chat_constraint(
    prompt: ChatPrompt,
    response_format: ResponseFormat | None,
    tokenizer: llguidance.LLTokenizer | None,
) -> Constraint | None:
    """A chat request's grammar: its tool calls' when forced or strict (with the format's JSON
    as the other way to answer), else its format's."""
    if prompt.tool_format is not None and (prompt.forced or prompt.strict_tools):
        return tool_constraint(prompt, tokenizer, _answer_schema(response_format))
    return response_constraint(response_format, tokenizer)


def _answer_schema(response_format: ResponseFormat | None) -> dict | None:
    if response_format is None or response_format.type == "text":
        return None
    if response_format.json_schema is None:
        return ANY_OBJECT
    return response_format.json_schema.schema_ or ANY_OBJECT


def response_constraint(
    response_format: ResponseFormat | None, tokenizer: llguidance.LLTokenizer | None
) -> Constraint | None:
    schema = _answer_schema(response_format)
    if schema is None:
        return None
    return _compiled("response_format", lambda t: Constraint.from_json_schema(t, schema), tokenizer)


def tool_constraint(prompt: ChatPrompt, tokenizer, answer: dict | None = None) -> Constraint:
    """The grammar of a forced call (`prompt.forced`: "required" or the named tool), or of the
    calls `auto` may make when some tools are strict (`answer`: the JSON schema a final answer
    must follow instead of free text)."""
    fmt, forced = prompt.tool_format, prompt.forced
    if forced is None:
        lark = _auto_calls_grammar(fmt, prompt.schemas, tokenizer, answer, prompt.max_calls)
    else:
        names = list(prompt.schemas) if forced == "required" else [forced]
        lark = _forced_call_grammar(fmt, prompt.schemas, names, forced == "required", tokenizer)
    return _compiled("tools", lambda t: Constraint.from_lark(t, lark), tokenizer)


def grammar_tokenizer(tokenizer: Any, vocab: int) -> llguidance.LLTokenizer | None:
    """llguidance's view of the served tokenizer, or None (logged) when it cannot read it (a
    tokenizer.json without a decoder, as tests' word-level ones): the server still serves,
    and a request that needs a grammar is a 400 saying why."""
    try:
        return tokenizer_from_json(tokenizer.to_json(), vocab, tokenizer.eos_token_ids)
    except ValueError as exc:
        log.warning("structured output off: llguidance cannot read the tokenizer: %s", exc)
        return None


def _compiled(param: str, build, tokenizer) -> Constraint:
    if tokenizer is None:
        raise ApiError(
            400,
            f"{param}: structured output is off: the grammar engine cannot read this model's "
            "tokenizer (see the server log)",
            param=param,
        )
    try:
        return build(tokenizer)
    except ValueError as exc:
        raise ApiError(400, f"{param}: {exc}", param=param) from None


# -- the call formats as llguidance Lark ----------------------------------------------------


def _forced_call_grammar(
    fmt: ToolCallFormat, schemas: Schemas, names: list[str], name_open: bool, tokenizer
) -> str:
    """After the prompt's forced opening: (the name, if still open) the arguments, the close."""
    close = _tag(CALL_CLOSE, tokenizer)
    alternatives = [
        _call_rest(fmt, name, schemas[name], i, name_open, close) for i, name in enumerate(names)
    ]
    rules = [rule for _, rule in alternatives]
    return "start: " + " | ".join(name for name, _ in alternatives) + "\n" + "\n".join(rules)


def _auto_calls_grammar(
    fmt: ToolCallFormat, schemas: Schemas, tokenizer, answer: dict | None, max_calls: int | None
) -> str:
    """Free text, or free text then calls (blanks between them), each call in the format and
    valid against its tool's schema. Text that ends the turn holds no opening tag; text before
    a call ends at its first one (a lazy lexeme: llguidance's way to end text at a tag). With
    an `answer` schema: that JSON, or calls alone. `parallel_tool_calls: false`: one call."""
    names = list(schemas)
    close, open_ = _tag(CALL_CLOSE, tokenizer), _tag(CALL_OPEN, tokenizer)
    calls = [_call_rest(fmt, name, schemas[name], i, True, close) for i, name in enumerate(names)]
    if open_.startswith("<["):  # a special token: never inside text
        lead = "lead: TEXT? " + open_
        final = "TEXT"
    else:
        lead = f"lead[lazy]: /(?s:.*)/ {open_}"
        final = f"/(?s:.*)/ & ~/(?s:.*){_regex_text(CALL_OPEN)}(?s:.*)/"
    finals = [f"FINAL: {final}", "final: FINAL"]
    if answer is not None:
        finals, lead = [f"final: %json {_compact(answer)}"], f"lead: {open_}"
    prefix = _lark(fmt.opening(None).removeprefix(CALL_OPEN))
    return "\n".join(
        [
            "start: final | lead call" + (" (more call)*" if max_calls != 1 else ""),
            *finals,
            "TEXT: /(?s:.*)/",
            lead,
            f"more: /\\s*/ {open_}",
            f"call: {prefix} ({' | '.join(name for name, _ in calls)})",
            *(rule for _, rule in calls),
        ]
    )


def _regex_text(text: str) -> str:
    return "".join("\\" + c if c in r"\.^$|?*+()[]{}/" else c for c in text)


def _call_rest(
    fmt: ToolCallFormat, name: str, schema: Mapping[str, Any], index: int, name_open: bool, close
) -> tuple[str, str]:
    """(the alternative's rule name, its rule): the call from where the opening left it."""
    rule = f"call_{index}"
    if fmt.name == "hermes":
        head = _lark(name + '", "arguments": ') if name_open else ""
        body = f"{head} args_{index} {_lark('}' + chr(10))} {close}"
        return rule, f"{rule}: {body}\nargs_{index}: %json {_compact(schema)}"
    head = _lark(name + ">\n") if name_open else ""
    params = _qwen3_coder_parameters(schema, index)
    return rule, f"{rule}: {head} {params[0]} {_lark('</function>' + chr(10))} {close}\n{params[1]}"


def _qwen3_coder_parameters(schema: Mapping[str, Any], index: int) -> tuple[str, str]:
    """`<parameter=KEY>\\nVALUE\\n</parameter>\\n` for each property in the schema's order (the
    required ones always, the others optionally); strings as text, the rest as JSON."""
    properties = schema.get("properties") or {}
    required = set(schema.get("required") or [])
    parts, rules = [], []
    for number, (key, value_schema) in enumerate(properties.items()):
        rule = f"param_{index}_{number}"
        value = _parameter_value(value_schema, f"value_{index}_{number}", rules)
        rules.append(f"{rule}: {_lark(f'<parameter={key}>' + chr(10))} {value}")
        parts.append(rule if key in required else f"{rule}?")
    return (" ".join(parts) or '""'), "\n".join(rules)


def _parameter_value(schema: Any, rule: str, rules: list[str]) -> str:
    kinds = schema.get("type") if isinstance(schema, Mapping) else None
    end = _lark("\n</parameter>\n")
    if kinds == "string" and "enum" not in schema:  # text up to the closing tag (lazy)
        longest = schema.get("maxLength")
        repeat = "*" if longest is None else "{0," + str(int(longest)) + "}"
        rules.append(f"{rule}[lazy]: /[^<]{repeat}/ {end}")
        return rule
    if kinds == "string":
        choices = " | ".join(_lark(str(choice)) for choice in schema["enum"])
        rules.append(f"{rule}: ({choices}) {end}")
        return rule
    rules.append(f"{rule}: %json {_compact(schema if isinstance(schema, Mapping) else {})} {end}")
    return rule


def _compact(schema: Mapping[str, Any]) -> str:
    guided = {**schema, "x-guidance": {**COMPACT, **(schema.get("x-guidance") or {})}}
    return json.dumps(guided, separators=(",", ":"))


def _lark(text: str) -> str:
    return json.dumps(text)  # a Lark string literal is a JSON string


def _tag(text: str, tokenizer) -> str:
    """A tag as the grammar must see it: its special token when the tokenizer has one."""
    ids = tokenizer.tokenize_str(text) if tokenizer is not None else []
    if len(ids) == 1 and tokenizer.is_special_token(ids[0]):
        return f"<[{ids[0]}]>"
    return _lark(text)
