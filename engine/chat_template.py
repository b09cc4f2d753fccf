"""Chat templates rendered as transformers' `apply_chat_template` renders them.

A model directory's chat template is a Jinja program written against the environment that
transformers gives it: a sandbox with `trim_blocks`/`lstrip_blocks`, the loop controls extension
(`break`, `continue`), a `{% generation %}` block tag, a `tojson` that does not escape HTML and
takes `indent`/`separators`/`sort_keys`, and the globals `raise_exception`, `strftime_now`, `dict`
and `namespace`. The variables are `messages` (keys whose value is None dropped, reasoning aliased
to `reasoning_content` and `thinking`), `tools`, `documents`, `add_generation_prompt`, the
tokenizer's special tokens and any extra keyword (e.g. `enable_thinking`).

    text = render(template, messages, tools=tools, add_generation_prompt=True,
                  special_tokens={"eos_token": "<|im_end|>"}, enable_thinking=False)

tests/engine/test_chat_template.py checks that this and transformers give byte-identical text.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

# The names a message's reasoning may come under; templates read the first (gpt-oss: "thinking").
REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")
# Variables the renderer itself sets (a request's chat_template_kwargs may not name them).
RESERVED_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt"})


class ChatTemplateError(ValueError):
    """The template refused the conversation (raise_exception) or failed to render."""


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; when
    rendering a prompt it renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render_body(self, caller: jinja2.runtime.Macro) -> str:
        return caller()


class _SafeNamespace(jinja2.utils.Namespace):
    """`namespace(...)` that refuses underscore-prefixed attributes (no reach into internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 (Namespace's own signature)
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _check_attribute(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_attribute(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


def _check_attribute(name: Any) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")


class _DictBuilder:
    """The template's `dict(...)`: builds dicts, exposes nothing else of the type."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any) -> dict:
        return dict.fromkeys(*args)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals.update(
        raise_exception=_raise_exception,
        strftime_now=_strftime_now,
        dict=_DictBuilder(),
        namespace=_SafeNamespace,
    )
    return env


@lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    return _environment().from_string(template)


@lru_cache(maxsize=8)
def template_variables(template: str) -> frozenset[str]:
    """The variables a template reads (e.g. whether it renders `tools` at all)."""
    return frozenset(jinja2.meta.find_undeclared_variables(_environment().parse(template)))


def template_messages(messages: list[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages as transformers hands them to a template: None-valued keys dropped, and a
    message's reasoning under both `reasoning_content` and `thinking`."""
    prepared = []
    for message in messages:
        plain = {key: value for key, value in message.items() if value is not None}
        reasoning = next((plain[key] for key in REASONING_KEYS if key in plain), None)
        if reasoning is not None:
            plain = {"thinking": reasoning, **plain, "reasoning_content": reasoning}
        prepared.append(plain)
    return prepared


def render(
    template: str,
    messages: list[Mapping[str, Any]],
    *,
    tools: list[dict] | None = None,
    documents: list[dict] | None = None,
    add_generation_prompt: bool = False,
    special_tokens: Mapping[str, str] | None = None,
    **kwargs: Any,
) -> str:
    """Render one conversation; a template error or refusal raises ChatTemplateError."""
    try:
        return _compile(template).render(
            messages=template_messages(messages),
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            **{**(special_tokens or {}), **kwargs},
        )
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"chat template: {exc}") from None
    except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
        # A template may index or call into a message it was not written for.
        raise ChatTemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from None
