"""A tiny byte-level BPE tokenizer (GPT-2 / Qwen style) for server and streaming tests.

Unlike the word-level tokenizer of tests/helpers/tiny_qwen3.py, any text encodes and a token may
hold part of a multi-byte character, so a random model's output exercises incremental
detokenization (U+FFFD tails) the way real Qwen tokenizers do.

    from tests.helpers.tiny_tokenizer import BYTE_VOCAB_SIZE, save_byte_tokenizer
    target_dir = save_tiny_qwen3(tmp_path / "m", vocab_size=BYTE_VOCAB_SIZE, tokenizer=False)
    save_byte_tokenizer(target_dir)

Ids: the special tokens of tiny_qwen3 first (so `<|im_end|>`, the eos, keeps its id), then the
256 byte symbols, then a few merges. Deterministic: no training.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from tests.helpers.tiny_qwen3 import CHAT_TEMPLATE, SPECIAL_TOKENS

# "Ġ" is the byte-level symbol of a space.
MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("e", "r"), ("o", "n")]
_BYTE_SYMBOLS = sorted(pre_tokenizers.ByteLevel.alphabet())
BYTE_VOCAB_SIZE = len(SPECIAL_TOKENS) + len(_BYTE_SYMBOLS) + len(MERGES)


def byte_tokenizer() -> Tokenizer:
    symbols = SPECIAL_TOKENS + _BYTE_SYMBOLS + [a + b for a, b in MERGES]
    tok = Tokenizer(models.BPE({s: i for i, s in enumerate(symbols)}, MERGES))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    return tok


def save_byte_tokenizer(path: str | Path) -> Path:
    """Write tokenizer.json and tokenizer_config.json (chat template, eos) into `path`."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    byte_tokenizer().save(str(path / "tokenizer.json"))
    config = {"chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>"}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path
