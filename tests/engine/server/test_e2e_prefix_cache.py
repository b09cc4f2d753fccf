"""The prefix cache served: an agent's conversation against the real `python -m engine serve` over
the demo pair, with the official `openai` client. Every turn answers the same with the cache on
and off (`"cache_prompt": false`), for ar and ddtree; from the second turn the cache holds the
history up to where the previous turn's messages ended; streamed usage reports it too; the
counters add up; the start-up plan names the cache.

Marked slow: one server process (torch import, the demo pair's load and warm-up).
"""

from __future__ import annotations

import copy
import json
import signal

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.prefix_cache import common_prefix
from engine.tokenizer import load_tokenizer
from tests.helpers.conversations import DEMO_TARGET, TOOLS
from tests.helpers.engine_server import start_engine_server

DEMO_DRAFT = DEMO_TARGET.parent / "draft"
TOOL_RESULT = "def read(path):\n    with open(path) as f:\n        return f.read()\n" * 12

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("prefix-cache") / "serve.log"
    extra = ["--max-model-len", "4096", "--budget", "8", "--prefix-cache-memory", "256MiB"]
    instance = start_engine_server(DEMO_TARGET, DEMO_DRAFT, extra_args=extra, log_path=log)
    yield instance
    assert instance.stop() == -signal.SIGTERM
    assert "Traceback" not in instance.log_text()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def ask(client, messages, method: str, cache: bool, thinking: bool = True):
    return client.chat.completions.create(
        model="target",
        messages=messages,
        tools=TOOLS,
        max_tokens=24,
        temperature=0,
        extra_body={
            "speculative": {"method": method},
            "cache_prompt": cache,
            "chat_template_kwargs": {"enable_thinking": thinking},
        },
    )


def messages_end(tokenizer, messages, **template) -> int:
    """The prompt token where the messages end, before the generation prompt (the tool calls'
    arguments as objects, as the server hands them to the template)."""
    rendered = copy.deepcopy(messages)
    for message in rendered:
        for call in message.get("tool_calls") or []:
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    whole = tokenizer.apply_chat_template(rendered, True, tools=TOOLS, **template)
    alone = tokenizer.apply_chat_template(rendered, False, tools=TOOLS, **template)
    return common_prefix(whole, alone)


@pytest.mark.parametrize(
    ("method", "thinking"), [("ddtree", True), ("ar", True), ("ddtree", False)]
)
def test_every_turn_answers_the_same_with_the_cache_on_and_off(client, method, thinking):
    """Thinking off, the generation prompt ends in an empty think block that the next turn does
    not render: it resumes where the messages ended (the server's checkpoint)."""
    tokenizer = load_tokenizer(DEMO_TARGET)
    messages = [
        {"role": "system", "content": f"You are a careful coding agent ({method}, {thinking})."},
        {"role": "user", "content": "What is the weather in Paris? Then read my notes."},
    ]
    previous_end = 0
    for turn in range(4):
        off = ask(client, messages, method, cache=False, thinking=thinking)
        on = ask(client, messages, method, cache=True, thinking=thinking)
        assert on.choices[0].message == off.choices[0].message, turn
        assert off.usage.prompt_tokens_details.cached_tokens == 0
        cached = on.usage.prompt_tokens_details.cached_tokens
        assert previous_end <= cached < on.usage.prompt_tokens  # the history, at least
        previous_end = messages_end(tokenizer, messages, enable_thinking=thinking)
        answer = on.choices[0].message
        messages.append({"role": "assistant", "content": answer.content or ""})
        if turn % 2 == 0:  # a tool call the agent made, and its result
            call = {"id": f"call_{turn}", "type": "function"}
            call["function"] = {"name": "search", "arguments": json.dumps({"query": "notes"})}
            messages[-1]["tool_calls"] = [call]
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": TOOL_RESULT})
        else:
            messages.append({"role": "user", "content": f"Thanks. Next step {turn}?"})
    assert previous_end > 600  # the conversation grew past a few hundred tokens


def test_streamed_usage_reports_the_cached_tokens(client):
    messages = [{"role": "user", "content": "Say something about caches."}]
    first = ask(client, messages, "ddtree", cache=True)
    history_end = messages_end(load_tokenizer(DEMO_TARGET), messages)
    messages += [{"role": "assistant", "content": first.choices[0].message.content or "ok"}]
    messages += [{"role": "user", "content": "And again?"}]
    stream = client.chat.completions.create(
        model="target",
        messages=messages,
        tools=TOOLS,
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    usage = [chunk.usage for chunk in stream if chunk.usage is not None]
    assert len(usage) == 1 and usage[0].prompt_tokens_details.cached_tokens >= history_end > 0


def test_the_counters_and_the_start_up_plan_show_the_cache(server):
    text = httpx.get(server.url + "/metrics").text
    totals = {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    hits = totals["ddops_engine_prefix_cache_hits_total"]
    assert 0 < hits < totals["ddops_engine_prefix_cache_queries_total"]
    log = server.log_text()
    assert "memory plan: prefix cache         256.0 MiB beside a context of 4096" in log
    # the plan's sequences are the scheduler's slots, of the served context
    assert "sequences at once: 4, each up to 4096 tokens (" in log
    assert "cache pool: 4 slots of 4096 tokens, KV block pools " in log
