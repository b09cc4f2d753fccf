"""TextAssembler: committed ids -> streamed text deltas, stop strings and stop tokens.

Uses the byte-level tokenizer of tests/helpers/tiny_tokenizer.py, so tokens can split
multi-byte characters exactly as real Qwen tokenizers do.
"""

from __future__ import annotations

import random

import pytest

from engine.server.text import TextAssembler
from tests.helpers.tiny_tokenizer import BYTE_VOCAB_SIZE, byte_tokenizer

TOKENIZER = byte_tokenizer()
EOS = TOKENIZER.token_to_id("<|im_end|>")
TEXT = "the café served 😀 crème brûlée, then ünïcode again: 日本語 and more text here"


def decode(ids: list[int]) -> str:
    return TOKENIZER.decode(ids)


def stream(assembler: TextAssembler, ids: list[int], round_sizes: list[int]) -> list[str]:
    deltas, start = [], 0
    for size in round_sizes:
        deltas.append(assembler.add(ids[start : start + size]))
        start += size
    deltas.append(assembler.finish())
    return deltas


def random_rounds(total: int, rng: random.Random) -> list[int]:
    sizes = []
    while sum(sizes) < total:
        sizes.append(rng.randint(1, 4))
    return sizes


@pytest.mark.parametrize("seed", range(5))
def test_streamed_deltas_join_to_the_full_decode(seed):
    rng = random.Random(seed)
    ids = TOKENIZER.encode(TEXT).ids
    deltas = stream(TextAssembler(decode), ids, random_rounds(len(ids), rng))
    assert "".join(deltas) == TEXT
    assert not any("\ufffd" in d for d in deltas), "a split character leaked as U+FFFD"


@pytest.mark.parametrize("seed", range(5))
def test_random_byte_soup_streams_like_its_full_decode(seed):
    """Invalid UTF-8 (a random model's output) still streams to exactly decode(all ids)."""
    rng = random.Random(seed)
    ids = [rng.randrange(3, BYTE_VOCAB_SIZE) for _ in range(60)]
    assembler = TextAssembler(decode)
    deltas = stream(assembler, ids, random_rounds(len(ids), rng))
    assert "".join(deltas) == decode(ids) == assembler.text


def test_text_stops_before_a_stop_string_that_straddles_rounds():
    ids = TOKENIZER.encode("alpha beta STOP gamma").ids
    assembler = TextAssembler(decode, stop_strings=["STOP"])
    deltas = stream(assembler, ids, [1] * len(ids))
    assert "".join(deltas) == "alpha beta "
    assert assembler.stopped
    assert "S" not in "".join(deltas[:-1]), "part of the stop string was shown before the cut"


def test_the_earliest_of_several_stop_strings_wins():
    ids = TOKENIZER.encode("one two three four").ids
    assembler = TextAssembler(decode, stop_strings=["four", "two"])
    assert "".join(stream(assembler, ids, [len(ids)])) == "one "


def test_a_stop_token_ends_the_text_and_later_ids_are_ignored():
    ids = TOKENIZER.encode("done").ids + [EOS] + TOKENIZER.encode(" more").ids
    assembler = TextAssembler(decode, stop_token_ids=[EOS])
    assert assembler.add(ids) == "done"
    assert assembler.stopped
    assert assembler.add(TOKENIZER.encode("x").ids) == ""
    assert assembler.finish() == ""


def test_without_stops_nothing_is_held_back():
    assembler = TextAssembler(decode)
    assert assembler.add(TOKENIZER.encode("hello").ids) == "hello"
