"""Logprobs in OpenAI's shapes: chat's `logprobs.content` (also the Responses API's output_text
`logprobs`) and the legacy completions' `logprobs` (tokens, token_logprobs, top_logprobs,
text_offset).

The engine gives each token's `TokenLogprob` (engine/sampling.py): its log-probability under
the distribution it was drawn from and the most likely alternatives. A token's text here is
the tokenizer's decoding of it alone, its `bytes` that text's UTF-8. A log-probability of -inf
(a token the grammar or the warps excluded) is sent as -9999.0, as vLLM does: JSON has no
infinity.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from engine.sampling import TokenLogprob

FLOOR = -9999.0  # what -inf is sent as


def _value(logprob: float) -> float:
    return max(logprob, FLOOR)


class LogprobShapes:
    """Turns `TokenLogprob`s into OpenAI's objects with the served tokenizer's `decode`."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode

    def text(self, token: int) -> str:
        return self._decode([token])

    def chat(self, entries: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
        """`ChatCompletionTokenLogprob`s (the Responses API's `LogProb`s are the same)."""
        return [
            {
                **self._token(entry.token, entry.logprob),
                "top_logprobs": [self._token(token, value) for token, value in entry.top],
            }
            for entry in entries
        ]

    def completion(
        self, tokens: Sequence[int], entries: Sequence[TokenLogprob | None], offset: int = 0
    ) -> dict[str, list]:
        """The legacy `logprobs` object of `tokens` (an entry is None for the prompt's first
        token, which nothing predicts); `offset`: where the first token's text starts in the
        choice's text."""
        texts = [self.text(token) for token in tokens]
        offsets = []
        for text in texts:
            offsets.append(offset)
            offset += len(text)
        return {
            "tokens": texts,
            "token_logprobs": [None if e is None else _value(e.logprob) for e in entries],
            "top_logprobs": [
                None if e is None else {self.text(t): _value(v) for t, v in e.top} for e in entries
            ],
            "text_offset": offsets,
        }

    def _token(self, token: int, logprob: float) -> dict[str, Any]:
        text = self.text(token)
        return {"token": text, "logprob": _value(logprob), "bytes": list(text.encode())}


def mean_logprob(entries: Sequence[TokenLogprob]) -> float:
    """A sequence's log-probability per token (best_of's ranking; -inf when empty)."""
    if not entries:
        return float("-inf")
    return sum(entry.logprob for entry in entries) / len(entries)
