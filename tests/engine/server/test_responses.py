"""The Responses API (`POST /v1/responses`) over a scripted engine behind the demo pair's chat
template, driven by the official `openai` client and the openai-agents SDK: a conversation of
items reaches the model exactly as the same conversation sent to chat completions, the output
comes back as reasoning, message and function_call items, whole or streamed, matching OpenAI's
own schemas (tests/data/openai/openapi.json), and an Agents SDK agent runs its tool loop.

The real model behind `python -m engine serve` answers the same in
tests/engine/server/test_e2e_responses.py.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from agents import Agent
from langchain_openai import ChatOpenAI

from engine.server.response_input import RESPONSES_ONLY_FIELDS, ResponsesRequest, chat_body
from engine.server.schemas import CHAT_API_FIELDS
from tests.helpers.agents_sdk import Weather, run_agent, weather_tool
from tests.helpers.conversations import PARALLEL, THINK_THEN_CALL, TOOLS, WEATHER_CALL
from tests.helpers.openai_spec import spec, violations
from tests.helpers.scripted_server import (
    WAIT_S,
    AgentTokenizer,
    RecordingEngine,
    loaded,
    prompt_text,
    running,
)

FLAT_TOOLS = [{"type": "function", **tool["function"]} for tool in TOOLS]
ANSWER = "<think>\nI have the weather.\n</think>\n\nSunny in Paris."


@pytest.fixture
def agent(agent_server):
    """(engine, base url, openai client); a test may set `engine.reply` or `engine.turns`."""
    engine, url = agent_server
    engine.reply, engine.turns, engine.prompts = THINK_THEN_CALL, [], []
    return engine, url, openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def post(url: str, **body) -> httpx.Response:
    return httpx.post(url + "/v1/responses", json=body, timeout=WAIT_S)


def stream_events(url: str, **body) -> list[dict]:
    with httpx.stream(
        "POST", url + "/v1/responses", json={**body, "stream": True}, timeout=WAIT_S
    ) as response:
        assert response.status_code == 200
        blocks = response.read().decode().strip().split("\n\n")
    events = []
    for block in blocks:
        name, data = block.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert name == f"event: {event['type']}"
        events.append(event)
    return events


def without_ids(value):
    """`value` with its generated ids blanked (they differ between two answers)."""
    if isinstance(value, list):
        return [without_ids(v) for v in value]
    if isinstance(value, dict):
        return {
            k: "*" if k in ("id", "call_id", "item_id") else without_ids(v)
            for k, v in value.items()
        }
    return value


# -- the answer --------------------------------------------------------------------------------


def test_a_tool_call_comes_back_as_reasoning_and_function_call_items(agent):
    _, url, client = agent
    raw = post(url, model="tiny", input="Weather in Paris?", tools=FLAT_TOOLS)
    assert violations("Response", raw.json()) == []
    response = client.responses.create(model="tiny", input="Weather in Paris?", tools=FLAT_TOOLS)
    assert response.status == "completed"
    reasoning, call = response.output
    assert reasoning.type == "reasoning"
    assert reasoning.content[0].text == "The user wants weather."
    assert (call.type, call.name, json.loads(call.arguments)) == (
        "function_call",
        "get_weather",
        {"city": "Paris"},
    )
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    assert response.usage.output_tokens == len(THINK_THEN_CALL) + 1  # + the eos
    assert response.usage.output_tokens_details.reasoning_tokens == len(
        "<think>\nThe user wants weather.\n</think>"
    )
    assert response.model_extra["speculative"]["method"] == "auto"


def test_an_answer_is_a_message_item_and_output_text(agent):
    engine, url, client = agent
    engine.reply = ANSWER
    response = client.responses.create(model="tiny", input="Weather?", instructions="Be terse.")
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output_text == "Sunny in Paris."
    assert response.output[1].content[0].annotations == []
    assert response.instructions == "Be terse."


def test_max_output_tokens_cuts_the_answer_short_as_incomplete(agent):
    engine, url, _ = agent
    body = post(url, input="Weather?", max_output_tokens=5).json()
    assert engine.configs[-1].max_new_tokens == 5
    assert (body["status"], body["incomplete_details"]) == (
        "incomplete",
        {"reason": "max_output_tokens"},
    )
    assert body["output"][0]["status"] == "incomplete"
    assert violations("Response", body) == []


# -- streamed ----------------------------------------------------------------------------------


def test_the_stream_matches_the_spec_and_rebuilds_the_whole_answer(agent):
    engine, url, _ = agent
    engine.reply = "<think>\nCheck.\n</think>\n\nLet me look.\n" + WEATHER_CALL
    events = stream_events(url, input="Weather in Paris?", tools=FLAT_TOOLS)
    for event in events:
        assert violations("ResponseStreamEvent", event) == [], event["type"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    types = [e["type"] for e in events]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[-1] == "response.completed"
    final = events[-1]["response"]
    assert [item["type"] for item in final["output"]] == ["reasoning", "message", "function_call"]
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == final["output"][1]["content"][0]["text"] == "Let me look."
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert done == final["output"]
    whole = post(url, input="Weather in Paris?", tools=FLAT_TOOLS).json()
    assert without_ids(whole["output"]) == without_ids(final["output"])


def test_the_openai_clients_stream_helper_accumulates_the_events(agent):
    engine, _, client = agent
    engine.reply = "<think>\nCheck.\n</think>\n\nLet me look.\n" + WEATHER_CALL
    with client.responses.stream(model="tiny", input="Weather?", tools=FLAT_TOOLS) as stream:
        final = stream.get_final_response()
    assert [item.type for item in final.output] == ["reasoning", "message", "function_call"]
    assert final.output_text == "Let me look."


# -- the request -------------------------------------------------------------------------------


def responses_items(messages: list[dict]) -> tuple[str | None, list[dict]]:
    """A chat conversation as the Responses API's instructions and input items."""
    instructions, items = None, []
    for message in messages:
        role, content = message["role"], message.get("content")
        if role == "system":
            instructions = content
        elif role == "tool":
            items.append(
                {
                    "type": "function_call_output",
                    "call_id": message["tool_call_id"],
                    "output": content,
                }
            )
        elif role == "assistant":
            if content is not None:
                part = {"type": "output_text", "text": content, "annotations": []}
                items.append({"type": "message", "role": "assistant", "content": [part]})
            for call in message.get("tool_calls") or []:
                function = call["function"]
                items.append(
                    {
                        "type": "function_call",
                        "call_id": call["id"],
                        "name": function["name"],
                        "arguments": json.dumps(function["arguments"]),
                    }
                )
        else:
            items.append({"role": role, "content": [{"type": "input_text", "text": content}]})
    return instructions, items


def test_a_conversation_of_items_is_the_prompt_chat_renders(agent):
    engine, url, _ = agent
    instructions, items = responses_items(PARALLEL)
    assert post(url, instructions=instructions, input=items, tools=FLAT_TOOLS).status_code == 200
    assert prompt_text(engine.prompts[-1]) == AgentTokenizer().render_chat(PARALLEL, tools=TOOLS)


def test_reasoning_items_return_as_the_assistant_turns_reasoning(agent):
    engine, url, _ = agent
    reasoning = {
        "type": "reasoning",
        "id": "rs_1",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": "Look it up."}],
    }
    call = {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"}
    output = {"type": "function_call_output", "call_id": "c1", "output": "sunny"}
    items = [{"role": "user", "content": "Weather?"}, reasoning, call, output]
    assert post(url, input=items, tools=FLAT_TOOLS).status_code == 200
    turn = {
        "role": "assistant",
        "content": None,
        "reasoning_content": "Look it up.",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {}}}
        ],
    }
    history = [items[0], turn, {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    assert prompt_text(engine.prompts[-1]) == AgentTokenizer().render_chat(history, tools=TOOLS)


def test_tool_choice_and_text_format_take_chats_path():
    named = {"type": "function", "name": "get_weather"}
    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    text_format = {"type": "json_schema", "name": "place", "schema": schema, "strict": True}
    body = chat_body(
        ResponsesRequest.model_validate(
            {
                "input": "x",
                "tools": FLAT_TOOLS,
                "tool_choice": named,
                "text": {"format": text_format},
            }
        )
    )
    assert body["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert body["tools"] == TOOLS
    assert body["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "place", "schema": schema, "strict": True},
    }
    plain = chat_body(
        ResponsesRequest.model_validate({"input": "x", "text": {"format": {"type": "text"}}})
    )
    assert "response_format" not in plain


def test_text_format_is_answered_as_chat_answers_response_format(agent):
    """Structured output is chat's own (constrained decoding): the same answer either way."""
    engine, url, _ = agent
    fmt = {"type": "json_object"}
    chat = httpx.post(
        url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "x"}], "response_format": fmt},
        timeout=WAIT_S,
    )
    responses = post(url, input="x", text={"format": fmt})
    assert responses.status_code == chat.status_code
    if chat.status_code == 400:
        assert responses.json()["error"]["param"] == "text.format"
    else:  # the same grammar reached the engine either way
        chat_cfg, responses_cfg = engine.configs[-2:]
        assert chat_cfg.constraint is not None
        assert responses_cfg.constraint.grammar == chat_cfg.constraint.grammar


def test_every_request_field_of_the_spec_is_read_or_forwarded_to_chat():
    properties = set()
    for part in spec()["components"]["schemas"]["CreateResponse"]["allOf"]:
        name = part.get("$ref", "").rsplit("/", 1)[-1]
        schema = spec()["components"]["schemas"][name] if name else part
        for sub in [schema, *schema.get("allOf", [])]:
            properties |= set(sub.get("properties", {}))
    declared = set(ResponsesRequest.model_fields)
    assert properties - declared - RESPONSES_ONLY_FIELDS - CHAT_API_FIELDS == set()


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"background": True}, "background"),
        ({"include": ["reasoning.encrypted_content"]}, "include"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input.0.type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
            "input.0.content.0.type",
        ),
        ({"input": [{"type": "function_call", "name": "f"}]}, "input.0.call_id"),
        ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"tool_choice": {"type": "file_search"}}, "tool_choice.type"),
        ({"reasoning": {"summary": "auto"}}, "reasoning.summary"),
        ({"text": {"verbosity": "high"}}, "text.verbosity"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
    ],
)
def test_what_cannot_be_honoured_is_a_400_naming_it(agent, body, param):
    _, url, _ = agent
    response = post(url, **{"input": "hi", **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_an_unknown_model_is_a_404_and_store_is_accepted(agent):
    _, url, _ = agent
    assert post(url, input="hi", model="gpt-5").json()["error"]["code"] == "model_not_found"
    assert post(url, input="hi", store=True, include=[], truncation="disabled").status_code == 200


def test_the_response_echoes_the_sampling_the_generation_used(agent):
    engine, url, _ = agent
    body = post(url, input="hi", temperature=0.5, top_p=0.75).json()
    assert (body["temperature"], body["top_p"]) == (0.5, 0.75)
    assert engine.configs[-1].sampling.top_p == 0.75
    defaults = post(url, input="hi", temperature=None, top_p=None).json()
    assert (defaults["temperature"], defaults["top_p"]) == (1.0, 1.0)  # null means the default


# -- the Agents SDK ----------------------------------------------------------------------------


@pytest.mark.parametrize("streamed", [False, True])
def test_an_agents_sdk_agent_calls_its_tool_then_answers(agent, streamed):
    engine, url, _ = agent
    engine.turns = [THINK_THEN_CALL, ANSWER]
    asked: list[str] = []
    weather = Agent(
        name="weather", instructions="Be terse.", model="tiny", tools=[weather_tool(asked)]
    )
    result = run_agent(url, weather, "Weather in Paris?", streamed=streamed)
    assert result.final_output == "Sunny in Paris."
    assert asked == ["Paris"]
    second_prompt = prompt_text(engine.prompts[-1])
    assert "<tool_response>\nsunny\n</tool_response>" in second_prompt
    assert second_prompt.startswith("<|im_start|>system\nBe terse.")


def test_an_agents_sdk_agent_with_an_output_type_returns_an_instance(agent):
    engine, url, _ = agent
    engine.reply = '{"city": "Paris", "sky": "sunny"}'
    typed = Agent(name="weather", model="tiny", output_type=Weather)
    assert run_agent(url, typed, "Weather in Paris?").final_output == Weather(
        city="Paris", sky="sunny"
    )


def test_a_failed_generation_is_a_500_or_a_response_failed_event():
    class FailingEngine(RecordingEngine):
        def generate(self, prompt_ids, cfg, **callbacks):
            if self.prompts:  # after the warm-up
                raise RuntimeError("the device fell over")
            return super().generate(prompt_ids, cfg, **callbacks)

    engine = FailingEngine("hi")
    with running(engine, load=lambda: loaded(engine, max_model_len=8192)) as (url, state):
        assert state.worker.ready.wait(WAIT_S)
        whole = post(url, input="hi")
        assert whole.status_code == 500
        assert "the device fell over" in whole.json()["error"]["message"]
        events = stream_events(url, input="hi")
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.failed",
    ]
    failed = events[-1]
    assert violations("ResponseStreamEvent", failed) == []
    assert failed["response"]["status"] == "failed"
    assert "the device fell over" in failed["response"]["error"]["message"]


@pytest.mark.parametrize("streaming", [False, True])
def test_langchains_chat_model_on_the_responses_api_gets_its_tool_call(agent, streaming):
    _, url, _ = agent
    model = ChatOpenAI(
        model="tiny",
        base_url=url + "/v1",
        api_key="none",
        use_responses_api=True,
        streaming=streaming,
        max_retries=0,
    )
    message = model.bind_tools(TOOLS).invoke("Weather in Paris?")
    (call,) = message.tool_calls
    assert (call["name"], call["args"]) == ("get_weather", {"city": "Paris"})
