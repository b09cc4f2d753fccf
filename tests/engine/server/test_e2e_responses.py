"""The Responses API against the real `python -m engine serve` over the demo pair: the answer
matches OpenAI's schema whole and streamed, its prompt is chat's for the same conversation, the
output is the same for ar and ddtree (speculation is lossless), and the openai-agents SDK's
default `Agent` with a function tool and an `output_type` runs to its typed answer.

Marked slow: one server process (torch import, the demo pair's load and warm-up).
"""

from __future__ import annotations

import asyncio
import signal

import httpx
import openai
import pytest
from agents import Agent, ModelSettings, RunConfig, Runner, function_tool
from agents.models.openai_provider import OpenAIProvider
from pydantic import BaseModel

from tests.helpers.conversations import DEMO_TARGET, TOOLS
from tests.helpers.engine_server import start_engine_server
from tests.helpers.openai_spec import violations

pytestmark = pytest.mark.slow

FLAT_TOOLS = [{"type": "function", **tool["function"]} for tool in TOOLS]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("responses") / "serve.log"
    extra = ["--max-model-len", "2048", "--budget", "8"]
    instance = start_engine_server(
        DEMO_TARGET, DEMO_TARGET.parent / "draft", extra_args=extra, log_path=log
    )
    yield instance
    assert instance.stop() == -signal.SIGTERM
    assert "Traceback" not in instance.log_text()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


ASK = {
    "model": "target",
    "instructions": "You are terse.",
    "input": "Weather in Paris?",
    "tools": FLAT_TOOLS,
    "max_output_tokens": 24,
    "temperature": 0,
}


def test_the_answer_matches_the_spec_and_its_prompt_is_chats(server):
    body = httpx.post(server.url + "/v1/responses", json=ASK, timeout=120).json()
    assert violations("Response", body) == []
    chat = {
        "messages": [
            {"role": "system", "content": ASK["instructions"]},
            {"role": "user", "content": ASK["input"]},
        ],
        "tools": TOOLS,
    }
    tokenized = httpx.post(server.url + "/tokenize", json=chat, timeout=60).json()
    assert body["usage"]["input_tokens"] == tokenized["count"]
    assert body["usage"]["output_tokens"] <= 24


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


class Weather(BaseModel):
    city: str
    sky: str


@pytest.mark.xfail(
    reason="the demo model calls tools and writes JSON only under constrained decoding "
    "(issue 30 Must 1: the server's tool_choice and response_format, i30g)",
    strict=True,
)
def test_an_agents_sdk_agent_with_a_function_tool_and_an_output_type_completes(server):
    asked = []

    @function_tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        asked.append(city)
        return "sunny"

    agent = Agent(
        name="weather",
        instructions="Call get_weather, then answer.",
        model="target",
        tools=[get_weather],
        output_type=Weather,
        model_settings=ModelSettings(tool_choice="required", temperature=0),
    )
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    config = RunConfig(model_provider=OpenAIProvider(openai_client=client), tracing_disabled=True)
    result = asyncio.run(Runner.run(agent, "Weather in Paris?", run_config=config, max_turns=4))
    assert len(asked) == 1
    assert isinstance(result.final_output, Weather)
