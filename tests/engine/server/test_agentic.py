"""Agent requests over HTTP: tools, tool-call history, tool_choice, the thinking switch, and the
fields the server refuses or ignores, driven by the official `openai` client.

The engine is scripted (tests/engine/server/test_http.py's ScriptedEngine: it commits a fixed reply two
characters per round) behind a character tokenizer whose chat template is the demo pair's own
(Qwen3's structure), so what reaches the model can be read back exactly and the reply can be a
tool call. The real model behind `python -m engine serve` is in tests/engine/server/test_e2e_agentic.py.
"""

from __future__ import annotations

import json
import logging

import httpx
import openai
import pytest

from engine.server.app import create_app
from engine.server.state import LoadedEngine, ServerConfig
from tests.helpers.conversations import (
    PARALLEL,
    THINK_THEN_CALL,
    TOOLS,
    WEATHER_CALL,
    openai_messages,
)
from tests.helpers.scripted_server import (
    WAIT_S,
    AgentTokenizer,
    CharTokenizer,
    RecordingEngine,
    prompt_text,
    serving,
)
from tests.helpers.tiny_grammar import codepoint_tokenizer

ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def agent_server():
    engine = RecordingEngine(THINK_THEN_CALL)
    tokenizer = AgentTokenizer()
    app = create_app(
        lambda: LoadedEngine(
            engine.generate, tokenizer, 8192, 0x110000, True, codepoint_tokenizer()
        ),
        ServerConfig(model_name="tiny"),
    )
    with serving(app) as url:
        assert app.state.server.worker.ready.wait(WAIT_S)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        yield engine, url, client


@pytest.fixture
def agent(agent_server):
    """(engine, base url, openai client); each test may set `engine.reply`."""
    engine = agent_server[0]
    engine.reply, engine.prompts = THINK_THEN_CALL, []
    return agent_server


def chat(client: openai.OpenAI, **options):
    return client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, **options)


def test_a_tool_call_comes_back_as_tool_calls_with_its_reasoning(agent):
    _, _, client = agent
    choice = chat(client).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert choice.message.model_extra["reasoning_content"] == "The user wants weather."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather",
        {"city": "Paris"},
    )


def test_streamed_tool_calls_accumulate_in_the_openai_client(agent):
    engine, _, client = agent
    engine.reply = "Checking both.\n" + WEATHER_CALL + "\n" + WEATHER_CALL.replace("Paris", "Rome")
    with client.chat.completions.stream(model="tiny", messages=ASK, tools=TOOLS) as stream:
        events = list(stream)
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking both."
    cities = [json.loads(c.function.arguments)["city"] for c in choice.message.tool_calls]
    assert cities == ["Paris", "Rome"]
    done = [e for e in events if e.type == "tool_calls.function.arguments.done"]
    assert [(e.index, e.name) for e in done] == [(0, "get_weather"), (1, "get_weather")]
    whole = chat(client).choices[0].message  # the same reply, not streamed
    assert [c.function.arguments for c in whole.tool_calls] == [
        c.function.arguments for c in choice.message.tool_calls
    ]


def test_streamed_reasoning_arrives_as_reasoning_content_deltas(agent):
    engine, _, client = agent
    engine.reply = "<think>\nShort thought.\n</think>\n\nSunny, 18 C."
    chunks = list(chat(client, stream=True))
    reasoning = "".join(
        c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in chunks
    )
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert (reasoning, content) == ("Short thought.", "Sunny, 18 C.")
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_malformed_tool_call_text_stays_in_the_content(agent):
    engine, _, client = agent
    engine.reply = '<tool_call>\n{"name": "get_weather", "arguments": {city: Paris}}\n</tool_call>'
    whole = chat(client).choices[0]
    streamed = "".join(c.choices[0].delta.content or "" for c in chat(client, stream=True))
    assert whole.finish_reason == "stop"
    assert whole.message.tool_calls is None
    assert whole.message.content == streamed == engine.reply


def test_tools_and_a_tool_call_history_reach_the_model_as_tokenize_shows(agent):
    engine, url, client = agent
    engine.reply = "Paris 18 C, Rome 24 C."
    body = {"model": "tiny", "messages": openai_messages(PARALLEL), "tools": TOOLS}
    client.chat.completions.create(**body)
    tokenized = httpx.post(url + "/tokenize", json=body, timeout=WAIT_S).json()
    assert tokenized["tokens"] == engine.prompts[-1]
    prompt = prompt_text(engine.prompts[-1])
    assert prompt == AgentTokenizer().render_chat(PARALLEL, tools=TOOLS)
    assert '"name": "search"' in prompt  # the tools block
    assert '{"name": "get_weather", "arguments": {"city": "Rome"}}' in prompt  # the history's call
    assert "<tool_response>\n24 C, clear\n</tool_response>" in prompt


def test_a_developer_message_is_the_system_turn_of_a_template_without_that_role(agent):
    engine, _, client = agent
    messages = [{"role": "developer", "content": "Be terse."}, *ASK]
    client.chat.completions.create(model="tiny", messages=messages)
    assert prompt_text(engine.prompts[-1]).startswith("<|im_start|>system\nBe terse.<|im_end|>\n")


def test_the_thinking_switch_reaches_the_template(agent):
    engine, _, client = agent
    engine.reply = "Sunny."
    reply = chat(client, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert prompt_text(engine.prompts[-1]).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert reply.choices[0].message.content == "Sunny."


def test_a_named_tool_choice_forces_that_call(agent):
    engine, url, client = agent
    engine.reply = '{"query": "cafés"}}\n</tool_call>'  # the model continues the forced opening
    choice = {"type": "function", "function": {"name": "search"}}
    reply = chat(client, tool_choice=choice).choices[0]
    prompt = prompt_text(engine.prompts[-1])
    assert prompt.endswith('<|im_start|>assistant\n<tool_call>\n{"name": "search", "arguments": ')
    assert reply.finish_reason == "tool_calls"
    assert reply.message.tool_calls[0].function.name == "search"
    assert json.loads(reply.message.tool_calls[0].function.arguments) == {"query": "cafés"}


def test_required_tool_choice_opens_a_call_of_any_tool(agent):
    engine, _, client = agent
    engine.reply = 'get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    reply = chat(client, tool_choice="required").choices[0]
    assert prompt_text(engine.prompts[-1]).endswith('<tool_call>\n{"name": "')
    assert reply.message.tool_calls[0].function.name == "get_weather"


def test_tool_choice_none_parses_nothing(agent):
    _, _, client = agent
    reply = chat(client, tool_choice="none").choices[0]
    assert reply.finish_reason == "stop"
    assert reply.message.tool_calls is None
    assert reply.message.content == THINK_THEN_CALL.split("</think>\n\n")[1]


def test_parallel_tool_calls_false_returns_one_call(agent):
    engine, _, client = agent
    engine.reply = WEATHER_CALL + "\n" + WEATHER_CALL.replace("Paris", "Rome")
    reply = chat(client, parallel_tool_calls=False).choices[0]
    assert [json.loads(c.function.arguments) for c in reply.message.tool_calls] == [
        {"city": "Paris"}
    ]


# -- refused and ignored fields -----------------------------------------------------------------

REFUSED = [
    ({"top_p": 1.5}, "top_p: Input should be less than or equal to 1"),
    ({"n": 129}, "n: Input should be less than or equal to 128"),
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs: Input should be less than or equal"),
    ({"top_logprobs": 2}, "top_logprobs: needs logprobs: true"),
    ({"top_k": -2}, "top_k: Input should be greater than or equal to -1"),
    ({"presence_penalty": 2.5}, "presence_penalty: Input should be less than or equal to 2"),
    ({"response_format": {"type": "json_schema"}}, "json_schema is required"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "nope"}},
            }
        },
        "response_format: grammar rejected",
    ),
    ({"functions": [{"name": "f"}]}, "'functions' is not implemented"),
    ({"reasoning_effort": "low"}, "'reasoning_effort' is not implemented"),
    (
        {"messages": [{"role": "user", "content": "hi", "function_call": {"name": "f"}}]},
        "'messages.0.function_call' is not implemented",
    ),
    ({"tool_choice": "required", "tools": None}, "tool_choice needs a non-empty 'tools' list"),
    (
        {"tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice names 'nope', which is not in tools",
    ),
    ({"tools": [{"type": "function", "function": {}}]}, "tools.0.function.name: Field required"),
    ({"messages": [{"role": "tool", "content": "18 C"}]}, "messages.0.tool_call_id is required"),
    ({"messages": [{"role": "user"}]}, "messages.0.content is required"),
    (
        {
            "messages": [
                {
                    "role": "assistant",
                    "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{x"}}],
                }
            ]
        },
        "messages.0.tool_calls.0.function.arguments is not JSON",
    ),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs may not set ['tools']"),
]


@pytest.mark.parametrize(("fields", "message"), REFUSED)
def test_what_the_server_cannot_honour_is_a_400_naming_it(agent, fields, message):
    engine, url, _ = agent
    body = {"messages": ASK, "tools": TOOLS, **fields}
    response = httpx.post(url + "/v1/chat/completions", json=body, timeout=WAIT_S)
    assert response.status_code == 400, response.text
    assert message in response.json()["error"]["message"]
    assert engine.prompts == []  # nothing reached the model


def test_unimplemented_completion_fields_are_refused(agent):
    _, url, _ = agent
    response = httpx.post(url + "/v1/completions", json={"prompt": "hi", "suffix": "x"})
    assert response.status_code == 400
    assert "'suffix' is not implemented" in response.json()["error"]["message"]


def test_no_op_values_are_accepted_and_unknown_fields_logged(agent, caplog):
    _, url, _ = agent
    body = {
        "messages": ASK,
        "top_p": 1,
        "presence_penalty": 0,
        "logprobs": False,
        "user": "u-1",
        "metadata": {"run": "7"},
        "guided_whitespace": 1,
        "beam_width": 2,
    }
    with caplog.at_level(logging.WARNING, logger="engine.server.schemas"):
        response = httpx.post(url + "/v1/chat/completions", json=body, timeout=WAIT_S)
    assert response.status_code == 200, response.text
    warnings = [r.getMessage() for r in caplog.records if r.name == "engine.server.schemas"]
    assert warnings == [
        "ignoring request fields outside the OpenAI API: guided_whitespace, beam_width"
    ]


def test_tools_for_a_template_that_cannot_render_them_are_refused():
    engine = RecordingEngine("hi")
    app = create_app(
        lambda: LoadedEngine(engine.generate, CharTokenizer(), 4096, 0x110000, True),
        ServerConfig(model_name="tiny"),
    )
    with serving(app) as url:
        assert app.state.server.worker.ready.wait(WAIT_S)
        body = {"messages": ASK, "tools": TOOLS}
        response = httpx.post(url + "/v1/chat/completions", json=body, timeout=WAIT_S)
    assert response.status_code == 400
    assert "chat template does not render tools" in response.json()["error"]["message"]
