"""engine/tools/prefix_cache_turns.py on a tiny pair: the conversation of token ids runs every turn
off and on, the second turn resumes from the first, and the medians land in --json.

Run: python -m pytest -q tests/engine/tools/test_prefix_cache_turns.py
"""

from __future__ import annotations

import json

import pytest

from engine.tools import prefix_cache_turns
from tests.helpers.tiny_qwen3 import save_tiny_dflash, save_tiny_qwen3

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_every_turn_matches_and_later_turns_resume(tmp_path, capsys):
    target = save_tiny_qwen3(tmp_path / "target", seed=2, tokenizer=False)
    draft = save_tiny_dflash(tmp_path / "draft", target)
    out = tmp_path / "turns.json"
    argv = ["--model", str(target), "--draft", str(draft), "--history", "40", "--turns", "2"]
    argv += ["--turn-tokens", "12", "--max-new-tokens", "6", "--max-len", "256", "--repeats", "2"]
    assert prefix_cache_turns.main([*argv, "--json", str(out)]) == 0
    turns = json.loads(out.read_text())["turns"]
    assert [(t["method"], t["turn"]) for t in turns] == [
        (m, n) for m in ("ar", "ddtree") for n in (1, 2, 3)
    ]
    assert all(t["same_output"] for t in turns)
    assert [t["cached_tokens"] for t in turns[:3]] == [0, 40 + 6 - 1, 40 + 6 + 12 + 6 - 1]
    assert capsys.readouterr().out.count("median ") == 6


def test_speculative_methods_need_a_drafter(tmp_path, capsys):
    assert prefix_cache_turns.main(["--model", str(tmp_path), "--methods", "ddtree"]) == 2
    assert capsys.readouterr().err.startswith("Error: --methods")
