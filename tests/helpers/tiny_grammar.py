"""Grammars over the tiny models' vocabularies, for the engine's constrained-decoding tests.

    tokenizer = char_tokenizer(96)              # id 0 the stop token, then one character each
    tokenizer = codepoint_tokenizer(0x300)      # id = code point (the scripted server's ids)
    constraint = Constraint.from_lark(tokenizer, 'start: "[" /[a-e]{1,6}/ "]"')

The tiny models have word-level tokenizers whose words no grammar can spell; these give each id
one character (then pairs of characters past the printable ones), so a grammar over text
constrains a random model's ids the way it constrains a real tokenizer's.
"""

from __future__ import annotations

import string

import llguidance

CHARACTERS = string.ascii_lowercase + string.digits + '{}[]":,. ' + string.ascii_uppercase
STOP = 0


class _Vocabulary:
    """What llguidance.TokenizerWrapper reads: token bytes, the stop id (0), an encoder."""

    def __init__(self, words: list[str]) -> None:
        self.tokens = [b"<|stop|>"] + [word.encode() for word in words]
        self.eos_token_id, self.bos_token_id, self.special_token_ids = STOP, None, [STOP]
        self._ids = {word: i for i, word in enumerate(self.tokens)}

    def __call__(self, text: bytes) -> list[int]:
        return [self._ids[c.encode()] for c in text.decode()]  # one character a token


def _char_words(vocab: int) -> list[str]:
    pairs = [a + b for a in CHARACTERS for b in CHARACTERS]
    return (list(CHARACTERS) + pairs)[: vocab - 1]


def char_tokenizer(vocab: int) -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Vocabulary(_char_words(vocab))))


def codepoint_tokenizer(limit: int = 0x300) -> llguidance.LLTokenizer:
    """Id = code point below `limit`, 0 the stop: tests/helpers/scripted_server.py's ids."""
    words = [chr(point) for point in range(1, limit)]
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Vocabulary(words)))


def spell(ids: list[int], vocab: int) -> str:
    """The text of ids (the stop token as nothing)."""
    tokens = _Vocabulary(_char_words(vocab)).tokens
    return "".join(tokens[i].decode() for i in ids if i != STOP)
