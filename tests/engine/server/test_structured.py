"""The grammars of engine/server/structured.py over the demo pair's tokenizer: a forced call in
either format (hermes JSON, qwen3_coder XML) accepts exactly the calls valid against the tool's
schema; `auto` with strict tools leaves text free and constrains a call once opened; a tag the
tokenizer holds as a special token is matched as that token.

Run: python -m pytest -q tests/engine/server/test_structured.py
"""

from __future__ import annotations

import llguidance
import pytest
from tokenizers import AddedToken, Tokenizer

from engine.grammar import tokenizer_from_json
from engine.server.chat import ChatPrompt
from engine.server.schemas import ApiError, ResponseFormat
from engine.server.structured import response_constraint, tool_constraint
from engine.server.tools import FORMATS
from tests.helpers.conversations import DEMO_TARGET

SCHEMAS = {
    "get_weather": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"],
    },
    "add": {
        "type": "object",
        "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
        "required": ["a", "b"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def demo_text():
    return Tokenizer.from_file(str(DEMO_TARGET / "tokenizer.json"))


@pytest.fixture(scope="module")
def grammar_tokenizer(demo_text):
    return tokenizer_from_json(demo_text.to_str(), 2048, [0])


def prompt(
    fmt: str, forced: str | None, strict: tuple[str, ...] = (), max_calls: int | None = None
) -> ChatPrompt:
    return ChatPrompt("", "", FORMATS[fmt], SCHEMAS, None, max_calls, forced, strict)


def accepts(constraint, text_tokenizer, text: str) -> bool:
    matcher = llguidance.LLMatcher(constraint.tokenizer, constraint.grammar)
    ids = text_tokenizer.encode(text, add_special_tokens=False).ids
    return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()


HERMES_NAMED = [
    ('{"city":"Paris"}}\n</tool_call>', True),
    ('{"city":"Paris","days":2}}\n</tool_call>', True),
    ('{"days":2}}\n</tool_call>', False),  # city is required
    ('{"city":"Paris"}}\n</tool_call>\nmore', False),  # the turn ends after the call
]
HERMES_REQUIRED = [
    ('add", "arguments": {"a":1,"b":2.5}}\n</tool_call>', True),
    ('add", "arguments": {"a":1,"b":2,"c":3}}\n</tool_call>', False),
    ('sub", "arguments": {}}\n</tool_call>', False),  # not a declared tool
]
CODER_NAMED = [
    ("<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>", True),
    (
        "<parameter=city>\nNew York\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
        "</function>\n</tool_call>",
        True,
    ),
    ("<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>", False),
    ("<parameter=city>\nParis\n</parameter>\n<parameter=days>\nx\n</parameter>\n", False),
]


@pytest.mark.parametrize(
    ("fmt", "forced", "cases"),
    [
        ("hermes", "get_weather", HERMES_NAMED),
        ("hermes", "required", HERMES_REQUIRED),
        ("qwen3_coder", "get_weather", CODER_NAMED),
    ],
)
def test_a_forced_call_accepts_exactly_the_valid_calls(
    demo_text, grammar_tokenizer, fmt, forced, cases
):
    constraint = tool_constraint(prompt(fmt, forced), grammar_tokenizer)
    for text, valid in cases:
        assert accepts(constraint, demo_text, text) == valid, text


@pytest.mark.parametrize("fmt", ["hermes", "qwen3_coder"])
def test_auto_with_strict_tools_frees_text_and_constrains_calls(demo_text, grammar_tokenizer, fmt):
    constraint = tool_constraint(prompt(fmt, None, ("add",)), grammar_tokenizer)
    opening = FORMATS[fmt].opening(None)
    if fmt == "hermes":
        good, bad = 'add", "arguments": {"a":1,"b":2}}', 'add", "arguments": {"x":1}}'
    else:
        good = "add>\n<parameter=a>\n1\n</parameter>\n<parameter=b>\n2\n</parameter>\n</function>"
        bad = "add>\n<parameter=a>\nq\n</parameter>\n</function>"
    assert accepts(constraint, demo_text, "No call needed, it is sunny.")
    assert accepts(constraint, demo_text, f"Sure.\n{opening}{good}\n</tool_call>")
    assert accepts(
        constraint, demo_text, f"{opening}{good}\n</tool_call>\n{opening}{good}\n</tool_call>"
    )
    assert not accepts(constraint, demo_text, f"Sure.{opening}{bad}\n</tool_call>")
    one = tool_constraint(prompt(fmt, None, ("add",), max_calls=1), grammar_tokenizer)
    assert accepts(one, demo_text, f"{opening}{good}\n</tool_call>")
    assert not accepts(
        one, demo_text, f"{opening}{good}\n</tool_call>\n{opening}{good}\n</tool_call>"
    )
    assert not accepts(constraint, demo_text, "text <tool_call> then nothing valid")


def test_auto_with_strict_tools_and_a_json_format_answers_json_or_calls(
    demo_text, grammar_tokenizer
):
    answer = {"type": "object", "properties": {"sky": {"enum": ["sunny", "grey"]}}}
    constraint = tool_constraint(prompt("hermes", None, ("add",)), grammar_tokenizer, answer)
    opening = FORMATS["hermes"].opening(None)
    assert accepts(constraint, demo_text, '{"sky":"grey"}')
    assert accepts(
        constraint, demo_text, opening + 'add", "arguments": {"a":1,"b":2}}\n</tool_call>'
    )
    assert not accepts(constraint, demo_text, '{"sky":"blue"}')
    assert not accepts(constraint, demo_text, "It is sunny.")


def test_a_special_token_tag_is_matched_as_that_token(demo_text):
    special = Tokenizer.from_str(demo_text.to_str())
    special.add_special_tokens(
        [AddedToken("<tool_call>", special=True), AddedToken("</tool_call>", special=True)]
    )
    open_id, close_id = special.token_to_id("<tool_call>"), special.token_to_id("</tool_call>")
    grammar_tokenizer = tokenizer_from_json(special.to_str(), special.get_vocab_size(), [0])
    constraint = tool_constraint(prompt("hermes", "get_weather"), grammar_tokenizer)
    assert f"<[{close_id}]>" in constraint.grammar
    ids = special.encode('{"city":"Oslo"}}\n', add_special_tokens=False).ids
    matcher = llguidance.LLMatcher(constraint.tokenizer, constraint.grammar)
    assert matcher.consume_tokens([*ids, close_id]) and matcher.is_accepting()
    auto = tool_constraint(prompt("hermes", None, ("add",)), grammar_tokenizer)
    assert f"<[{open_id}]>" in auto.grammar


def test_response_formats_compile_or_are_refused_by_name(grammar_tokenizer):
    assert response_constraint(None, grammar_tokenizer) is None
    assert response_constraint(ResponseFormat(type="text"), grammar_tokenizer) is None
    assert response_constraint(ResponseFormat(type="json_object"), grammar_tokenizer) is not None
    bad = ResponseFormat.model_validate(
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 7}}}
    )
    with pytest.raises(ApiError, match="response_format: grammar rejected") as refused:
        response_constraint(bad, grammar_tokenizer)
    assert refused.value.status == 400 and refused.value.param == "response_format"


def test_a_tokenizer_the_grammar_engine_cannot_read_turns_structured_output_off(tmp_path, caplog):
    """A tokenizer.json without a decoder (the tests' word-level ones) loads, with structured
    output off: the server still serves, a request that needs a grammar is a 400 saying why."""
    from engine.server.structured import grammar_tokenizer
    from engine.tokenizer import load_tokenizer
    from tests.helpers.tiny_qwen3 import save_tiny_tokenizer

    save_tiny_tokenizer(tmp_path, 96)
    with caplog.at_level("WARNING", logger="engine.server.structured"):
        assert grammar_tokenizer(load_tokenizer(tmp_path), 96) is None
    assert "structured output off" in caplog.text
    with pytest.raises(ApiError, match="structured output is off") as refused:
        response_constraint(ResponseFormat(type="json_object"), None)
    assert refused.value.status == 400
