"""An agent's requests against the real `python -m engine serve` over the demo pair, with the
official `openai` client: tools and a tool-call history are accepted and reach the model exactly
as its chat template renders them (checked through /tokenize with the same body), the thinking
switch reaches the template, and an OpenAI field the server does not implement is a 400.

Marked slow: one server process (torch import, the demo pair's load and warm-up).
"""

from __future__ import annotations

import httpx
import openai
import pytest

from engine.tokenizer import load_tokenizer
from tests.helpers.conversations import DEMO_TARGET, PARALLEL, TOOLS, openai_messages

pytestmark = pytest.mark.slow


def agent_body(**extra) -> dict:
    return {
        "model": "target",
        "messages": openai_messages(PARALLEL),
        "tools": TOOLS,
        "max_tokens": 8,
        "temperature": 0,
        **extra,
    }


def test_the_server_picks_the_parsers_the_demo_template_teaches(server_process):
    assert "tool-call parser hermes, reasoning parser qwen3" in server_process.log_text()


def test_tools_and_a_tool_call_history_reach_the_model(server_process, client):
    body = agent_body()
    completion = client.chat.completions.create(**body)
    tokenized = httpx.post(server_process.url + "/tokenize", json=body, timeout=60).json()
    expected = load_tokenizer(DEMO_TARGET).apply_chat_template(PARALLEL, tools=TOOLS)
    assert tokenized["tokens"] == expected
    assert completion.usage.prompt_tokens == tokenized["count"]
    assert completion.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert completion.model_extra["speculative"]["method"] == "auto"


def test_a_streamed_agent_turn_equals_the_non_streamed_one(client):
    body = agent_body()
    chunks = [c for c in client.chat.completions.create(**body, stream=True) if c.choices]
    whole = client.chat.completions.create(**body).choices[0]
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == (
        whole.message.content or ""
    )


def test_the_thinking_switch_reaches_the_template(server_process):
    body = agent_body(chat_template_kwargs={"enable_thinking": False})
    tokens = httpx.post(server_process.url + "/tokenize", json=body, timeout=60).json()["tokens"]
    tokenizer = load_tokenizer(DEMO_TARGET)
    assert tokenizer.decode(tokens, False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )


def test_an_unimplemented_openai_field_is_a_400_naming_it(client):
    with pytest.raises(openai.BadRequestError, match="'prediction' is not implemented"):
        client.chat.completions.create(**agent_body(prediction={"type": "content", "content": "x"}))
