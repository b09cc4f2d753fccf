"""The Responses API against the real `python -m engine serve` over the demo pair: the answer
matches OpenAI's schema whole and streamed, its prompt is chat's for the same conversation, the
output is the same for ar and ddtree (speculation is lossless), a repeated conversation's usage
counts the prefix it read from the cache, and the openai-agents SDK's default `Agent` with a
function tool and an `output_type` runs to its typed answer.

Marked slow: one server process (torch import, the demo pair's load and warm-up).
"""

from __future__ import annotations

import httpx
import pytest
from agents import Agent, ModelSettings

from tests.helpers.agents_sdk import Weather, run_agent, weather_tool
from tests.helpers.conversations import TOOLS
from tests.helpers.openai_spec import violations

pytestmark = pytest.mark.slow

FLAT_TOOLS = [{"type": "function", **tool["function"]} for tool in TOOLS]


ASK = {
    "model": "target",
    "instructions": "You are terse.",
    "input": "Weather in Paris?",
    "tools": FLAT_TOOLS,
    "max_output_tokens": 24,
    "temperature": 0,
}


def test_the_answer_matches_the_spec_and_its_prompt_is_chats(server_process):
    body = httpx.post(server_process.url + "/v1/responses", json=ASK, timeout=120).json()
    assert violations("Response", body) == []
    chat = {
        "messages": [
            {"role": "system", "content": ASK["instructions"]},
            {"role": "user", "content": ASK["input"]},
        ],
        "tools": TOOLS,
    }
    tokenized = httpx.post(server_process.url + "/tokenize", json=chat, timeout=60).json()
    assert body["usage"]["input_tokens"] == tokenized["count"]
    assert body["usage"]["output_tokens"] <= 24


def test_a_repeated_conversation_reads_its_prefix_from_the_cache(server_process):
    def usage() -> dict:
        answer = httpx.post(server_process.url + "/v1/responses", json=ASK, timeout=120)
        return answer.json()["usage"]

    first, second = usage(), usage()
    assert second["input_tokens"] == first["input_tokens"]
    assert 0 < second["input_tokens_details"]["cached_tokens"] <= second["input_tokens"]


def produced(item) -> tuple[str, str]:
    """An output item's kind and text (its arguments, for a call)."""
    if item.type == "function_call":
        return item.type, item.arguments
    return item.type, "".join(part.text for part in item.content)


def test_streamed_equals_whole_and_ar_equals_ddtree(client):
    def output(method: str, stream: bool) -> list[tuple[str, str]]:
        options = {**ASK, "extra_body": {"speculative": {"method": method}}}
        if not stream:
            return [produced(item) for item in client.responses.create(**options).output]
        events = list(client.responses.create(**options, stream=True))
        assert events[-1].type == "response.incomplete"  # 24 tokens cut the babble short
        return [produced(e.item) for e in events if e.type == "response.output_item.done"]

    whole = output("ddtree", False)
    assert whole and all(text for _, text in whole)
    assert whole == output("ddtree", True) == output("ar", False)


@pytest.mark.parametrize("streamed", [False, True])
def test_an_agents_sdk_agent_with_a_function_tool_and_an_output_type_completes(
    server_process, streamed
):
    """The tool turn is forced (tool_choice required), the answer constrained to the output
    type's schema: the demo model babbles, but within the grammar."""
    asked: list[str] = []
    agent = Agent(
        name="weather",
        instructions="Call get_weather, then answer.",
        model="target",
        tools=[weather_tool(asked, once=True)],
        output_type=Weather,
        model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=160),
    )
    result = run_agent(server_process.url, agent, "Weather in Paris?", streamed=streamed)
    assert len(asked) == 1
    assert isinstance(result.final_output, Weather)
