"""Prompts for the bench scenarios, sized with the server's own token counts (/tokenize).

    decode_prompt()                                   # one fixed short code prompt
    fit = long_prompt(client.count_tokens, max_model_len=32768, max_tokens=256)
    fit.prompt, fit.tokens                            # fit.tokens + 256 == 32768, or fit.skipped
    transcript = AgenticTranscript(client.count_tokens, AgenticShape(4096, 4), max_tokens, limit)
    prompt = transcript.prompt_for_turn(0); ...; prompt = transcript.prompt_for_turn(1, answer)

`long` fills max-model-len minus max_tokens to the exact token: a binary search on the length of
a filler text, then a last-token touch-up, each step asking the server to count. The incident
this guards against: a "25k-token" prompt counted on the client side was 400-refused because
the server counted more than 32768. A prompt that cannot fit is skipped with the numbers.

`agentic` is a coding agent's tool-using conversation in Qwen3's chat format (ChatML, a tools
block of JSON signatures in the system turn, hermes `<tool_call>` JSON, tool results as
`<tool_response>` user turns): byte for byte what the demo pair's chat template renders for the
same OpenAI messages (`transcript.messages`, `AGENT_TOOLS`). Each turn appends the model's previous
answer, a `read_file` call and its result, sized so the context grows evenly to ~`context` tokens
at the last turn. It goes to /v1/completions as text, so every model gets this format.
Filler text is Python source from the standard library (deterministic for a Python version).
A `session` name opens the system message, so the bench's sessions are distinct conversations.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass

from ops.bench.matrix import AgenticShape

CountTokens = Callable[[str], int]

DECODE_PROMPT = (
    'import os\nimport sys\n\n\ndef main(argv):\n    """Parse the arguments and run."""\n'
)
LONG_HEAD = "Read the following source code, then continue it.\n\n"
AGENT_SYSTEM = "You are a coding agent. Use the tools to inspect the repository, then fix the bug."
AGENT_TASK = "The parser drops the last line of its input. Find the cause and fix it."


def _function(name: str, description: str, **properties: str) -> dict:
    schema = {"type": "object", "properties": {k: {"type": t} for k, t in properties.items()}}
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": schema},
    }


AGENT_TOOLS = (
    _function("read_file", "Read a file of the repository", path="string"),
    _function("grep", "Search the repository for a regular expression", pattern="string"),
    _function("run_tests", "Run the tests under a path and report the failures", path="string"),
)
# Qwen3's layout, in the demo pair's template's words (tests/ops/bench/test_agentic.py checks them).
TOOLS_BLOCK = (
    "\n\n# Tools\n\nYou can call functions to help with the request.\n\n"
    "Their signatures are listed between <tools></tools> XML tags:\n<tools>{signatures}\n</tools>"
    "\n\nTo call a function, reply with a JSON object of its name and arguments between "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{{"name": <function-name>, "arguments": '
    "<args-json-object>}}\n</tool_call>"
)
RESULT_HEAD = "<|im_start|>user\n<tool_response>\n"
RESULT_TAIL = "\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
# Single characters tried to land on the exact count when the filler's next character
# would overshoot by more than one token.
TOUCH_UP_CHARACTERS = (" ", ".", "\n", "a", "x", "0")
_FILLER_SOURCES = ("textwrap", "json.decoder", "shlex", "fractions", "heapq", "difflib")


def decode_prompt() -> str:
    return DECODE_PROMPT


@functools.cache
def _source_text() -> str:
    return "\n".join(inspect.getsource(importlib.import_module(m)) for m in _FILLER_SOURCES)


def filler_text(min_chars: int, start: int = 0) -> str:
    """At least `min_chars` characters of real Python source (standard-library modules), from
    character `start` of it on."""
    text = _source_text()
    start %= len(text)
    text = text[start:] + text[:start]
    return (text * (min_chars // len(text) + 1))[: max(min_chars, 1)]


def _source_start(module: str) -> int:
    """Where `module`'s source begins in the filler text."""
    sources = [inspect.getsource(importlib.import_module(m)) for m in _FILLER_SOURCES]
    index = _FILLER_SOURCES.index(module)
    return sum(len(source) + 1 for source in sources[:index])


@dataclass(frozen=True)
class FittedPrompt:
    """A prompt sized for a token budget, or why it cannot be (skipped, with the numbers)."""

    prompt: str
    tokens: int  # the server's count of `prompt`
    target: int  # the count asked for
    skipped: str | None = None

    @property
    def exact(self) -> bool:
        return self.skipped is None and self.tokens == self.target


def fit_to_tokens(
    count: CountTokens, head: str, target: int, tail: str = "", start: int = 0
) -> FittedPrompt:
    """head + filler + tail with as much filler (from character `start` of the source text) as
    fits in `target` tokens, exactly when reachable; skipped when head + tail alone exceed it."""
    least = count(head + tail)
    if least > target:
        return FittedPrompt(head + tail, least, target, skipped=f"needs {least} tokens")
    filler = filler_text(8 * (target - least) + 64, start)
    while count(head + filler + tail) <= target:  # a tokenizer packing > 8 characters a token
        filler += filler
    # The largest n with count(head + filler[:n] + tail) <= target (counts grow with n).
    low, high = 0, len(filler)
    while low < high:
        middle = (low + high + 1) // 2
        if count(head + filler[:middle] + tail) <= target:
            low = middle
        else:
            high = middle - 1
    return _touch_up(count, head + filler[:low], tail, target)


def _touch_up(count: CountTokens, body: str, tail: str, target: int) -> FittedPrompt:
    """Close a gap left where the filler's next character adds several tokens at once."""
    tokens = count(body + tail)
    while tokens < target:
        for character in TOUCH_UP_CHARACTERS:
            grown = count(body + character + tail)
            if tokens < grown <= target:
                body, tokens = body + character, grown
                break
        else:
            break  # no single character closes the gap: the nearest fit below it stands
    return FittedPrompt(body + tail, tokens, target)


def long_prompt(count: CountTokens, *, max_model_len: int, max_tokens: int) -> FittedPrompt:
    """A prompt of exactly max_model_len - max_tokens tokens (by the server's count)."""
    target = max_model_len - max_tokens
    least = count(LONG_HEAD)
    if least > target:
        why = (
            f"the prompt needs at least {least} tokens; with max_tokens {max_tokens} that is "
            f"{least + max_tokens} > max-model-len {max_model_len}"
        )
        return FittedPrompt(LONG_HEAD, least, target, skipped=why)
    return fit_to_tokens(count, LONG_HEAD, target)


def agent_system(session: str | None = None) -> str:
    """The system message: a session's own first line makes its conversation its own (no other
    session's prefix cache serves it beyond a few tokens)."""
    return f"Session {session}. {AGENT_SYSTEM}" if session else AGENT_SYSTEM


def agent_head(session: str | None = None) -> str:
    """The conversation's start: the system turn with the tools block, the task, the
    assistant's turn opening."""
    signatures = "".join("\n" + json.dumps(tool, ensure_ascii=False) for tool in AGENT_TOOLS)
    system = agent_system(session) + TOOLS_BLOCK.format(signatures=signatures)
    return (
        f"<|im_start|>system\n{system}<|im_end|>\n"
        f"<|im_start|>user\n{AGENT_TASK}<|im_end|>\n<|im_start|>assistant\n"
    )


def tool_call_text(name: str, arguments: dict) -> str:
    call = {"name": name, "arguments": arguments}
    return "<tool_call>\n" + json.dumps(call, ensure_ascii=False) + "\n</tool_call>"


class AgenticTranscript:
    """The growing conversation of the agentic scenario: one prompt per turn.

    Turn k's prompt is sized to head + k/(turns-1) of the way to (context - max_tokens), where
    context is the shape's context capped at max-model-len; the last turn ends at ~context.
    Turn k > 0 adds the model's answer to turn k-1, its call `read_file(<module k>)`, and that
    module's source as the result (as much as the turn's size allows).
    """

    def __init__(
        self,
        count: CountTokens,
        shape: AgenticShape,
        max_tokens: int,
        max_model_len: int,
        session: str | None = None,
    ) -> None:
        self.count = count
        self.shape = shape
        self.max_tokens = max_tokens
        self.context = min(shape.context, max_model_len)
        self.prompt = agent_head(session)
        self.head_tokens = count(self.prompt)
        self.messages: list[dict] = [
            {"role": "system", "content": agent_system(session)},
            {"role": "user", "content": AGENT_TASK},
        ]

    @property
    def skipped(self) -> str | None:
        if self.head_tokens + self.max_tokens > self.context:
            return (
                f"the agent prompt needs {self.head_tokens} tokens; with max_tokens "
                f"{self.max_tokens} that is {self.head_tokens + self.max_tokens} > the "
                f"{self.context}-token context"
            )
        return None

    def turn_target(self, turn: int) -> int:
        """The prompt tokens turn `turn` (0-based) should have."""
        last = self.context - self.max_tokens
        if self.shape.turns == 1:
            return last
        return self.head_tokens + (last - self.head_tokens) * turn // (self.shape.turns - 1)

    def prompt_for_turn(self, turn: int, previous_answer: str = "") -> FittedPrompt:
        """Turn 0: the task. Later turns: the conversation + the previous answer, its tool call
        and the tool's result."""
        if turn == 0:
            return fit_to_tokens(self.count, self.prompt, self.turn_target(0))
        module = _FILLER_SOURCES[(turn - 1) % len(_FILLER_SOURCES)]
        call = {"path": module.replace(".", "/") + ".py"}
        answer = previous_answer.lstrip("\n")
        said = answer + "\n" if answer else ""
        head = self.prompt + said + tool_call_text("read_file", call) + "<|im_end|>\n" + RESULT_HEAD
        fitted = fit_to_tokens(
            self.count, head, self.turn_target(turn), RESULT_TAIL, _source_start(module)
        )
        # Skipped here means the previous answer ran past the ramp: the tool result stays empty.
        result = fitted.prompt[len(head) : len(fitted.prompt) - len(RESULT_TAIL)]
        tool_call = {"id": f"call_{turn}", "type": "function"}
        tool_call["function"] = {"name": "read_file", "arguments": json.dumps(call)}
        self.messages += [
            {"role": "assistant", "content": answer or None, "tool_calls": [tool_call]},
            {"role": "tool", "tool_call_id": f"call_{turn}", "content": result},
        ]
        self.prompt = fitted.prompt
        return fitted
