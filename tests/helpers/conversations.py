"""An agent's conversations for the chat-template and server tests: tools, tool calls (one and
parallel), tool responses, and the demo pair's target whose template renders them.

`openai_messages` turns a conversation into what an OpenAI client sends (arguments as JSON).
"""

from __future__ import annotations

import copy
import json

from tests.helpers import DATA, REPO

DEMO_TARGET = REPO / "engine" / "demo_model" / "target"
TEMPLATES = DATA / "chat_templates"

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the web – returns «snippets»",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string"}, "filters": {"type": "object"}},
        },
    },
}
TOOLS = [WEATHER, SEARCH]


def call(call_id: str, name: str, arguments: dict) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


SYSTEM = {"role": "system", "content": "You are terse."}
ASK = {"role": "user", "content": "Weather in Paris and Rome?"}
PARIS = call("call_1", "get_weather", {"city": "Paris", "days": 2})
ROME = call("call_2", "get_weather", {"city": "Rome"})
FIND = call("call_3", "search", {"query": "café", "filters": {"site": "x.org", "n": [1, 2]}})
ONE_CALL = [ASK, {"role": "assistant", "content": None, "tool_calls": [PARIS]}]
PARALLEL = [
    SYSTEM,
    ASK,
    {"role": "assistant", "content": None, "tool_calls": [PARIS, ROME]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": "24 C, clear"},
    {"role": "assistant", "content": "Paris 18 C, Rome 24 C."},
    {"role": "user", "content": "Now search for cafés."},
]

# What a model with the demo template's format answers: a hermes call, after its reasoning.
WEATHER_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
THINK_THEN_CALL = "<think>\nThe user wants weather.\n</think>\n\n" + WEATHER_CALL


def openai_messages(messages: list[dict]) -> list[dict]:
    """The conversation as an OpenAI client sends it: tool-call arguments as JSON strings."""
    sent = copy.deepcopy(messages)
    for message in sent:
        for tool_call in message.get("tool_calls") or []:
            tool_call["function"]["arguments"] = json.dumps(tool_call["function"]["arguments"])
    return sent
