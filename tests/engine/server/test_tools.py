"""Output parsing for agents: tool calls (hermes, qwen3_coder) and <think> reasoning.

Each case is fed whole, one character at a time and in random pieces: the deltas must join to
the same content, reasoning and calls however the text streams in (the server streams engine
rounds and answers non-streamed requests from one piece).
"""

from __future__ import annotations

import json
import random

import pytest

from engine.server.chat import ChatOutput, ChatPrompt, OutputParsing, build_chat_prompt
from engine.server.reasoning import ReasoningSplitter, prompt_opens_reasoning
from engine.server.schemas import ApiError, ChatRequest, parse_body
from engine.server.state import ServerConfig, output_parsing
from engine.server.tools import FORMATS, ToolCallExtractor, detect_format
from tests.helpers.conversations import DEMO_TARGET, TEMPLATES, TOOLS
from tests.helpers.scripted_server import CharTokenizer

SCHEMAS = {
    "get_weather": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    },
    "search": {"type": "object", "properties": {"query": {"type": "string"}}},
}


def chunkings(text: str) -> list[list[str]]:
    rng = random.Random(len(text))
    pieces, start = [], 0
    while start < len(text):
        size = rng.randint(1, 7)
        pieces.append(text[start : start + size])
        start += size
    return [[text], list(text), pieces]


def extract(format_name: str, pieces: list[str]) -> tuple[str, list[tuple[str, dict]]]:
    extractor = ToolCallExtractor(FORMATS[format_name], SCHEMAS)
    out = [item for piece in pieces for item in extractor.feed(piece)] + extractor.finish()
    content = "".join(item for item in out if isinstance(item, str))
    calls = [(c.name, json.loads(c.arguments)) for c in out if not isinstance(c, str)]
    return content, calls


HERMES_CASES = [
    (
        "single",
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        "</tool_call>",
        "Let me check.",
        [("get_weather", {"city": "Paris"})],
    ),
    (
        "parallel",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
        '</tool_call>\n<tool_call>\n{"name": "search", "arguments": {"query": "café «x»"}}\n'
        "</tool_call>\n",
        "",
        [("get_weather", {"city": "Paris", "days": 2}), ("search", {"query": "café «x»"})],
    ),
    (
        "arguments_as_a_json_string",
        '<tool_call>{"name": "search", "arguments": "{\\"query\\": \\"q\\"}"}</tool_call>',
        "",
        [("search", {"query": "q"})],
    ),
    (
        "unclosed_at_the_end_but_whole",
        '<tool_call>\n{"name": "search", "arguments": {"query": "q"}}\n',
        "",
        [("search", {"query": "q"})],
    ),
    ("plain_text", "No tools needed.\n", "No tools needed.\n", []),
    (
        "malformed_json_stays_content",
        'Try:\n<tool_call>\n{"name": "search", "arguments": {"query": }\n</tool_call>',
        'Try:\n<tool_call>\n{"name": "search", "arguments": {"query": }\n</tool_call>',
        [],
    ),
    (
        "an_undeclared_tool_stays_content",
        '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call> done',
        '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call> done',
        [],
    ),
    (
        "unclosed_and_cut_off_stays_content",
        'ok <tool_call>\n{"name": "search", "argu',
        'ok <tool_call>\n{"name": "search", "argu',
        [],
    ),
    (
        "a_bad_call_between_good_ones",
        '<tool_call>{"name": "search", "arguments": {"query": "a"}}</tool_call>\n'
        "<tool_call>{oops}</tool_call>\n"
        '<tool_call>{"name": "search", "arguments": {"query": "b"}}</tool_call>',
        "<tool_call>{oops}</tool_call>",
        [("search", {"query": "a"}), ("search", {"query": "b"})],
    ),
    ("a_lone_angle_bracket", "a < b and <tool but no call", "a < b and <tool but no call", []),
]


@pytest.mark.parametrize(("name", "text", "content", "calls"), HERMES_CASES)
def test_hermes_calls_however_the_text_streams(name, text, content, calls):
    for pieces in chunkings(text):
        assert extract("hermes", pieces) == (content, calls)


QWEN3_CODER_TEXT = (
    "I'll look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSão Paulo\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=search>\n"
    "<parameter=query>\n42\n</parameter>\n</function>\n</tool_call>"
)


def test_qwen3_coder_calls_typed_by_the_schema():
    for pieces in chunkings(QWEN3_CODER_TEXT):
        content, calls = extract("qwen3_coder", pieces)
        assert content == "I'll look."
        # days is an integer in the schema; query is a string even though it reads as a number.
        assert calls == [
            ("get_weather", {"city": "São Paulo", "days": 3}),
            ("search", {"query": "42"}),
        ]


def test_qwen3_coder_malformed_stays_content():
    text = "<tool_call>\n<function=search>\nstray text\n</function>\n</tool_call>"
    assert extract("qwen3_coder", [text]) == (text, [])


def test_the_format_follows_the_chat_template():
    assert detect_format("... <tool_call>\n{...}\n</tool_call> ...").name == "hermes"
    assert detect_format("<tool_call>\n<function=NAME>\n<parameter=").name == "qwen3_coder"
    assert detect_format("{% for m in messages %}{{ m.content }}{% endfor %}") is None


# What a model writes after a forced opening: of the named tool, or of any tool (None).
CONTINUATIONS = {
    ("hermes", "get_weather"): '{"city": "Paris"}}\n</tool_call>',
    ("hermes", None): 'get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    (
        "qwen3_coder",
        "get_weather",
    ): "<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>",
    (
        "qwen3_coder",
        None,
    ): "get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>",
}


@pytest.mark.parametrize(("format_name", "tool"), CONTINUATIONS)
def test_forced_openings_parse_back_to_the_call(format_name, tool):
    fmt = FORMATS[format_name]
    text = fmt.opening(tool) + CONTINUATIONS[format_name, tool]
    assert extract(format_name, [text]) == ("", [("get_weather", {"city": "Paris"})])


# -- reasoning --------------------------------------------------------------------------------

REASONING_CASES = [
    # (prompt ends inside <think>?, output, reasoning, content)
    (True, "\nthe user wants x\n</think>\n\nHere is x.", "the user wants x", "Here is x."),
    (False, "<think>\nhmm\n\nhmm\n</think>\n\nAnswer", "hmm\n\nhmm", "Answer"),
    (False, "  <think>short</think>Answer", "short", "Answer"),
    (False, "Just an answer with </think> inside", "", "Just an answer with </think> inside"),
    (False, "<thin", "", "<thin"),
    (True, "still thinking when cut off\n", "still thinking when cut off\n", ""),
    (False, "", "", ""),
]


@pytest.mark.parametrize(("opened", "text", "reasoning", "content"), REASONING_CASES)
def test_reasoning_splits_however_the_text_streams(opened, text, reasoning, content):
    for pieces in chunkings(text) if text else [[""]]:
        splitter = ReasoningSplitter(opened)
        parts = [splitter.feed(piece) for piece in pieces] + [splitter.finish()]
        assert "".join(r for r, _ in parts) == reasoning
        assert "".join(c for _, c in parts) == content


def test_the_prompt_says_whether_output_starts_in_reasoning():
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_reasoning("<think>a</think> <|im_start|>assistant\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n")


# -- both, as the server uses them ----------------------------------------------------------


def chat_output(**overrides) -> ChatOutput:
    settings = dict(
        text="",
        opening="",
        tool_format=FORMATS["hermes"],
        schemas=SCHEMAS,
        starts_in_reasoning=True,
        max_calls=None,
    )
    return ChatOutput(ChatPrompt(**{**settings, **overrides}))


AGENT_TURN = (
    "Two cities.\n</think>\n\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
)


def test_reasoning_then_parallel_calls_make_one_message_streamed_or_not():
    messages = []
    for pieces in chunkings(AGENT_TURN):
        output = chat_output()
        deltas = [d for piece in pieces for d in output.feed(piece)] + output.finish()
        message = output.message(deltas)
        for call in message["tool_calls"]:
            call.pop("id")
        messages.append(message)
        assert [d["tool_calls"][0]["index"] for d in deltas if "tool_calls" in d] == [0, 1]
    assert messages[0] == {
        "role": "assistant",
        "content": None,
        "refusal": None,
        "reasoning_content": "Two cities.",
        "tool_calls": [
            {
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            },
            {
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
            },
        ],
    }
    assert messages[1:] == messages[:1] * 2


def test_parallel_tool_calls_false_keeps_the_first_call():
    output = chat_output(max_calls=1)
    message = output.message(output.feed(AGENT_TURN) + output.finish())
    assert [json.loads(c["function"]["arguments"]) for c in message["tool_calls"]] == [
        {"city": "Paris"}
    ]


def test_a_forced_opening_is_the_start_of_the_output():
    opening = FORMATS["hermes"].opening("search")
    output = chat_output(opening=opening, starts_in_reasoning=False)
    message = output.message(output.feed('{"query": "x"}}\n</tool_call>') + output.finish())
    assert message["content"] is None
    assert message["tool_calls"][0]["function"] == {"name": "search", "arguments": '{"query": "x"}'}


def test_without_parsers_the_text_is_all_content():
    output = chat_output(tool_format=None, starts_in_reasoning=None)
    message = output.message(output.feed(AGENT_TURN) + output.finish())
    assert message == {"role": "assistant", "content": AGENT_TURN, "refusal": None}


class ThinkingRenderer(CharTokenizer):
    """A Qwen3.5-style template: its generation prompt opens <think>, its calls are XML."""

    chat_template = (TEMPLATES / "qwen3_5_style.jinja").read_text()


def test_a_forced_call_first_closes_the_think_block_the_prompt_opened():
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS}
    parsing = OutputParsing(detect_format(ThinkingRenderer.chat_template), reasoning=True)
    auto = build_chat_prompt(
        parse_body(ChatRequest, json.dumps(body).encode()), ThinkingRenderer(), parsing
    )
    assert auto.text.endswith("<|im_start|>assistant\n<think>\n") and auto.starts_in_reasoning
    body["tool_choice"] = {"type": "function", "function": {"name": "search"}}
    forced = build_chat_prompt(
        parse_body(ChatRequest, json.dumps(body).encode()), ThinkingRenderer(), parsing
    )
    assert forced.text == auto.text + "\n</think>\n\n<tool_call>\n<function=search>\n"
    assert forced.starts_in_reasoning is False
    output = ChatOutput(forced)
    deltas = output.feed("<parameter=query>\nqwen\n</parameter>\n</function>\n</tool_call>")
    message = output.message(deltas + output.finish())
    assert message["tool_calls"][0]["function"] == {
        "name": "search",
        "arguments": '{"query": "qwen"}',
    }


def test_the_serve_flags_override_what_the_template_teaches():
    demo = (DEMO_TARGET / "chat_template.jinja").read_text()
    auto = output_parsing(ServerConfig(model_name="m"), demo)
    assert (auto.tool_format.name, auto.reasoning) == ("hermes", True)
    chosen = ServerConfig(model_name="m", tool_call_parser="qwen3_coder", reasoning_parser="none")
    assert (
        output_parsing(chosen, demo).tool_format.name,
        output_parsing(chosen, demo).reasoning,
    ) == (
        "qwen3_coder",
        False,
    )
    off = output_parsing(ServerConfig(model_name="m", tool_call_parser="none"), demo)
    assert off.tool_format is None
    plain = output_parsing(ServerConfig(model_name="m"), "{{ messages }}")
    assert (plain.tool_format, plain.reasoning) == (None, False)


def test_tools_without_a_parser_are_refused_unless_tool_choice_is_none():
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS}
    no_parser = OutputParsing(None, reasoning=False)
    with pytest.raises(ApiError, match="tool_choice 'auto' needs a tool-call parser"):
        build_chat_prompt(
            parse_body(ChatRequest, json.dumps(body).encode()), ThinkingRenderer(), no_parser
        )
    body["tool_choice"] = "none"
    prompt = build_chat_prompt(
        parse_body(ChatRequest, json.dumps(body).encode()), ThinkingRenderer(), no_parser
    )
    assert "<name>search</name>" in prompt.text and prompt.tool_format is None
