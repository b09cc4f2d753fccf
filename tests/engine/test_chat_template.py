"""Our chat-template rendering against transformers' `apply_chat_template`: byte-identical.

Three templates in Qwen3's structure (tools block, tool calls, tool responses, thinking switch):
the demo pair's own, a Qwen3.5-style one (XML tool calls, <think> opened in the generation
prompt) and one that reaches for the rest of transformers' Jinja environment (bos_token,
strftime_now, documents, dict, tojson options, {% generation %}, loop controls,
raise_exception). Every message shape an agent sends goes through both renderers, once as
plain dicts (engine/chat_template.py via engine/tokenizer.py) and once as an OpenAI request body
through the server's own path (engine/server/chat.py: `content: null`, arguments as JSON strings).
transformers is handed the arguments as objects, as its docs ask; the server reads them so too.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from engine.chat_template import ChatTemplateError, render, template_variables
from engine.server.chat import OutputParsing, build_chat_prompt
from engine.server.schemas import ApiError, ChatRequest, parse_body
from engine.server.tools import FORMATS
from engine.tokenizer import load_tokenizer
from tests.helpers.conversations import (
    ASK,
    DEMO_TARGET,
    FIND,
    ONE_CALL,
    PARALLEL,
    PARIS,
    ROME,
    SYSTEM,
    TEMPLATES,
    TOOLS,
    openai_messages,
)
from tests.helpers.tiny_tokenizer import byte_tokenizer

# name -> (messages, extra apply_chat_template arguments)
CASES = {
    "plain": ([{"role": "user", "content": "hi"}], {}),
    "system": ([SYSTEM, {"role": "user", "content": "hi"}], {}),
    "multi_turn": (
        [
            SYSTEM,
            ASK,
            {"role": "assistant", "content": "Sunny."},
            {"role": "user", "content": "ok"},
        ],
        {},
    ),
    "tools": ([ASK], {"tools": TOOLS}),
    "tools_and_system": ([SYSTEM, ASK], {"tools": TOOLS}),
    "call_with_null_content": (
        [*ONE_CALL, {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}],
        {"tools": TOOLS},
    ),
    "call_after_content": (
        [
            ASK,
            {"role": "assistant", "content": "Let me look.", "tool_calls": [FIND]},
            {"role": "tool", "tool_call_id": "call_3", "content": '{"hits": 3}'},
        ],
        {"tools": TOOLS},
    ),
    "parallel_calls_results_and_follow_up": (PARALLEL, {"tools": TOOLS}),
    "reasoning_in_history": (
        [
            ASK,
            {
                "role": "assistant",
                "content": None,
                "reasoning_content": "Two cities: two calls.",
                "tool_calls": [PARIS, ROME],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
            {"role": "tool", "tool_call_id": "call_2", "content": "24 C"},
        ],
        {"tools": TOOLS},
    ),
    "think_inline_in_content": (
        [ASK, {"role": "assistant", "content": "<think>\nEasy.\n</think>\n\nSunny."}],
        {"add_generation_prompt": False},
    ),
    "thinking_off": ([ASK], {"tools": TOOLS, "enable_thinking": False}),
    "thinking_on": ([ASK], {"enable_thinking": True}),
    "no_generation_prompt": (PARALLEL[:3], {"add_generation_prompt": False, "tools": TOOLS}),
    "documents": (
        [ASK],
        {"documents": [{"title": "Guide", "text": "Paris is mild."}, {"title": "B", "text": "x"}]},
    ),
    "tool_result_without_a_call": (
        [ASK, {"role": "tool", "tool_call_id": "call_9", "content": "?"}],
        {},
    ),
}


def write_model_dir(path: Path, template: str) -> Path:
    """A tokenizer directory (byte-level BPE) with `template` as its chat template."""
    path.mkdir(parents=True)
    byte_tokenizer().save(str(path / "tokenizer.json"))
    config = {"eos_token": "<|im_end|>", "bos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "chat_template.jinja").write_text(template)
    return path


@pytest.fixture(scope="module", params=["demo", "qwen3_5_style", "qwen3_extras"])
def model_dir(request, tmp_path_factory) -> Path:
    if request.param == "demo":
        return DEMO_TARGET
    template = (TEMPLATES / f"{request.param}.jinja").read_text()
    return write_model_dir(tmp_path_factory.mktemp("tok") / request.param, template)


@pytest.fixture(scope="module")
def pair(model_dir):
    return load_tokenizer(model_dir), AutoTokenizer.from_pretrained(model_dir)


def transformers_render(hf, messages: list[dict], options: dict) -> str | type[Exception]:
    options = {"add_generation_prompt": True, **options}
    try:
        return hf.apply_chat_template(copy.deepcopy(messages), tokenize=False, **options)
    except Exception as exc:  # whatever it raises, ours must refuse too
        return type(exc)


def ours_render(tok, messages: list[dict], options: dict) -> str | type[Exception]:
    options = dict(options)
    generation_prompt = options.pop("add_generation_prompt", True)
    try:
        return tok.render_chat(copy.deepcopy(messages), generation_prompt, **options)
    except ChatTemplateError as exc:
        return type(exc)


@pytest.mark.parametrize("case", CASES)
def test_every_message_shape_renders_byte_identical(pair, case):
    ours, hf = pair
    messages, options = CASES[case]
    expected = transformers_render(hf, messages, options)
    got = ours_render(ours, messages, options)
    if case == "tool_result_without_a_call" and "must follow an assistant" in ours.chat_template:
        assert not isinstance(expected, str), "the template's raise_exception did not fire"
    if isinstance(expected, str):
        assert got == expected
    else:
        assert got is ChatTemplateError, f"transformers raised {expected.__name__}, we rendered"


# A chat request always asks for the generation prompt.
REQUEST_CASES = [
    name for name, (_, options) in CASES.items() if "add_generation_prompt" not in options
]


@pytest.mark.parametrize("case", REQUEST_CASES)
def test_an_openai_request_renders_as_transformers_renders_its_conversation(pair, case):
    ours, hf = pair
    messages, options = CASES[case]
    expected = transformers_render(hf, messages, options)
    body = {"messages": openai_messages(messages), **_request_fields(options)}
    request = parse_body(ChatRequest, json.dumps(body).encode())
    parsing = OutputParsing(FORMATS["hermes"], reasoning=True)
    if "documents" in options and "documents" not in template_variables(ours.chat_template):
        # transformers renders the conversation without them; the server refuses to drop them.
        with pytest.raises(ApiError, match="does not render documents"):
            build_chat_prompt(request, ours, parsing)
    elif isinstance(expected, str):
        assert build_chat_prompt(request, ours, parsing).text == expected
    else:
        with pytest.raises(ApiError, match="messages: chat template"):
            build_chat_prompt(request, ours, parsing)


def _request_fields(options: dict) -> dict:
    fields = {k: options[k] for k in ("tools", "documents") if k in options}
    kwargs = {k: v for k, v in options.items() if k not in fields}
    return {**fields, "chat_template_kwargs": kwargs} if kwargs else fields


def test_the_demo_template_gives_transformers_token_ids():
    ours, hf = load_tokenizer(DEMO_TARGET), AutoTokenizer.from_pretrained(DEMO_TARGET)
    messages, options = CASES["parallel_calls_results_and_follow_up"]
    expected = hf.apply_chat_template(
        copy.deepcopy(messages), add_generation_prompt=True, return_dict=False, **options
    )
    assert ours.apply_chat_template(copy.deepcopy(messages), **options) == expected


def test_the_demo_template_speaks_qwen3s_format():
    messages, options = CASES["reasoning_in_history"]
    text = load_tokenizer(DEMO_TARGET).render_chat(messages, **options, enable_thinking=False)
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in text
    assert (
        "<|im_start|>assistant\n<think>\nTwo cities: two calls.\n</think>\n\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n18 C\n</tool_response>\n"
        "<tool_response>\n24 C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    ) in text
    # A plain chat renders as the bare ChatML the demo pair was trained on.
    plain = load_tokenizer(DEMO_TARGET).render_chat([{"role": "user", "content": "hi"}])
    assert plain == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_template_errors_are_one_type():
    with pytest.raises(ChatTemplateError, match="boom"):
        render("{{ raise_exception('boom') }}", [])
    with pytest.raises(ChatTemplateError, match="has no attribute 'nope'"):
        render("{{ messages[0].content.nope() }}", [{"role": "user", "content": "a"}])
    with pytest.raises(ChatTemplateError, match="TypeError"):
        render("{{ messages[0].content + 1 }}", [{"role": "user", "content": "a"}])
