"""Structured output, forced tool calls and Qwen's sampling settings against the real
`python -m engine serve` over the demo pair (which babbles): the openai client's
`response_format` gets schema-valid JSON, the same for ar and ddtree; LangChain's
`with_structured_output(<pydantic model>)` returns an instance; `tool_choice` `required` and
named always give `tool_calls` whose arguments validate; a strict tool's call under `auto` is
valid when the model makes one; Qwen's recommended settings answer 200.

Marked slow: one server process (conftest's `server_process`: the demo pair, budget 8).
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

pytestmark = pytest.mark.slow

CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "population": {"type": "integer", "minimum": 0, "maximum": 100000000},
        "capital": {"type": "boolean"},
    },
    "required": ["city", "population", "capital"],
    "additionalProperties": False,
}


def tool(name: str, properties: dict) -> dict:
    """A function tool whose arguments are bounded: a babbling model's call must end."""
    parameters = {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


TOOLS = [
    tool(
        "get_weather", {"city": {"type": "string", "maxLength": 24}, "unit": {"enum": ["C", "F"]}}
    ),
    tool(
        "add", {"a": {"type": "integer", "minimum": -999, "maximum": 999}, "b": {"type": "boolean"}}
    ),
]
QWEN_THINKING = {"temperature": 0.6, "top_p": 0.95, "presence_penalty": 1.5}
QWEN_EXTRAS = {"top_k": 20, "min_p": 0.0, "repetition_penalty": 1.0}
PROMPTS = ["Describe Paris.", "Tell me about a city by the sea.", "Weather in Oslo tomorrow?"]


def ask(
    client: openai.OpenAI,
    content: str,
    method: str = "ddtree",
    extra: dict | None = None,
    **options,
):
    return client.chat.completions.create(
        model="target",
        messages=[{"role": "user", "content": content}],
        max_tokens=160,
        extra_body={"speculative": {"method": method}, **(extra or {})},
        **options,
    )


def test_a_json_schema_format_gives_valid_json_the_same_for_ar_and_ddtree(client):
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "city", "schema": CITY, "strict": True},
    }
    for prompt in PROMPTS:
        answers = {}
        for method in ("ar", "linear", "ddtree"):
            choice = ask(client, prompt, method, response_format=response_format, temperature=0)
            assert choice.choices[0].finish_reason == "stop"
            answers[method] = choice.choices[0].message.content
            jsonschema.validate(json.loads(answers[method]), CITY)
        assert answers["ar"] == answers["linear"] == answers["ddtree"]


def test_json_object_gives_an_object_for_chat_and_completions(client):
    chat = ask(client, PROMPTS[0], response_format={"type": "json_object"}, temperature=0)
    assert isinstance(json.loads(chat.choices[0].message.content), dict)
    text = client.completions.create(
        model="target",
        prompt="A JSON object:",
        max_tokens=160,
        temperature=0,
        extra_body={"response_format": {"type": "json_object"}},
    )
    assert text.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(text.choices[0].text), dict)


class City(BaseModel):
    city: str = Field(max_length=20)
    population: int = Field(ge=0, le=100_000_000)
    capital: bool


def test_langchain_with_structured_output_returns_an_instance(server_process):
    model = ChatOpenAI(
        model="target",
        base_url=server_process.url + "/v1",
        api_key="none",
        temperature=0,
        max_tokens=160,
    )
    answer = model.with_structured_output(City).invoke("Describe Paris.")
    assert isinstance(answer, City)


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_a_forced_tool_choice_always_gives_valid_tool_calls(client, choice):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for prompt in PROMPTS:
        for method, options in [
            ("ar", {"temperature": 0}),
            ("ddtree", {**QWEN_THINKING, "seed": 3}),
        ]:
            completion = ask(client, prompt, method, tools=TOOLS, tool_choice=choice, **options)
            message = completion.choices[0].message
            assert completion.choices[0].finish_reason == "tool_calls", message
            call = message.tool_calls[0].function
            if isinstance(choice, dict):
                assert call.name == "get_weather"
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])


def test_a_strict_tools_call_is_valid_when_the_model_makes_one(client):
    strict = [{**t, "function": {**t["function"], "strict": True}} for t in TOOLS]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for seed in range(4):
        completion = ask(client, PROMPTS[2], tools=strict, seed=seed, **QWEN_THINKING)
        for call in completion.choices[0].message.tool_calls or []:
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_qwens_recommended_settings_answer(client):
    for method in ("ar", "ddtree"):
        completion = ask(client, PROMPTS[0], method, seed=1, extra=QWEN_EXTRAS, **QWEN_THINKING)
        assert completion.choices[0].finish_reason in ("stop", "length")
        assert completion.usage.completion_tokens > 0
