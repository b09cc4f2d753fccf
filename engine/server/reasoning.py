"""Reasoning (`<think>...</think>`) split from the answer, for OpenAI's `reasoning_content`.

Qwen3-family models think inside `<think>...</think>` before they answer. Where a generation
starts depends on the prompt: Qwen3.5/3.6 templates open `<think>\\n` in the generation prompt,
Qwen3's leave the model to write `<think>` itself, and `enable_thinking=false` renders an empty,
closed block. So a `ReasoningSplitter` starts inside the block when the prompt ends inside one
(`prompt_opens_reasoning`), and otherwise enters it only if the output begins with `<think>`.

    splitter = ReasoningSplitter(prompt_opens_reasoning(prompt_text))
    reasoning, content = splitter.feed(delta)   # as text arrives
    reasoning, content = splitter.finish()      # the end

A tag split across deltas is held back until it resolves. The newlines just inside the block
and just after `</think>` are trimmed, as Qwen's templates trim them when the turn is rendered
back into a prompt. Output that never closes its block is all reasoning.
"""

from __future__ import annotations

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
# What closes a block the prompt left open, e.g. before a forced tool call.
CLOSE_OPEN_BLOCK = "\n" + THINK_CLOSE + "\n\n"

# `serve --reasoning-parser`: "auto" parses when the chat template mentions <think>.
REASONING_PARSERS = ("auto", "none", "qwen3")

_UNDECIDED, _REASONING, _CONTENT = "undecided", "reasoning", "content"


def prompt_opens_reasoning(prompt: str) -> bool:
    """Whether the prompt ends inside a think block, so the output starts as reasoning."""
    return prompt.rfind(THINK_OPEN) > prompt.rfind(THINK_CLOSE)


def partial_tag_length(text: str, tag: str) -> int:
    """How many trailing characters of `text` could begin `tag` (and so must wait)."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


class ReasoningSplitter:
    """Splits streamed output text into (reasoning, content) deltas."""

    def __init__(self, starts_in_reasoning: bool) -> None:
        self._state = _REASONING if starts_in_reasoning else _UNDECIDED
        self._pending = ""
        self._trim_newlines = starts_in_reasoning  # the newline right after an opening tag

    def feed(self, text: str) -> tuple[str, str]:
        self._pending += text
        return self._drain(final=False)

    def finish(self) -> tuple[str, str]:
        return self._drain(final=True)

    def _drain(self, *, final: bool) -> tuple[str, str]:
        reasoning = content = ""
        if self._state == _UNDECIDED:
            self._decide(final)
        if self._state == _REASONING:
            reasoning = self._take_reasoning(final)
        if self._state == _CONTENT:
            content, self._pending = self._trimmed(self._pending), ""
        return reasoning, content

    def _decide(self, final: bool) -> None:
        start = self._pending.lstrip()
        if start.startswith(THINK_OPEN):
            self._pending = start[len(THINK_OPEN) :]
            self._state, self._trim_newlines = _REASONING, True
        elif final or not THINK_OPEN.startswith(start):
            self._state = _CONTENT

    def _take_reasoning(self, final: bool) -> str:
        end = self._pending.find(THINK_CLOSE)
        if end >= 0:
            piece = self._trimmed(self._pending[:end]).rstrip("\n")
            self._pending = self._pending[end + len(THINK_CLOSE) :]
            self._state, self._trim_newlines = _CONTENT, True
            return piece
        keep = 0 if final else partial_tag_length(self._pending, THINK_CLOSE)
        ready = self._pending[: len(self._pending) - keep]
        if not final:  # newlines may be the ones before </think>: wait for what follows
            keep += len(ready) - len(ready.rstrip("\n"))
            ready = ready.rstrip("\n")
        self._pending = self._pending[len(self._pending) - keep :] if keep else ""
        return self._trimmed(ready)

    def _trimmed(self, text: str) -> str:
        if self._trim_newlines:
            text = text.lstrip("\n")
            self._trim_newlines = not text
        return text
