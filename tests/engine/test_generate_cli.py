"""`python -m engine generate` (engine/cli/generate.py) and the tokenizer (engine/tokenizer.py).

Run: python -m pytest -q tests/engine/test_generate_cli.py
"""

from __future__ import annotations

import json

import pytest
import torch

from engine.__main__ import main
from engine.decode import GenerationConfig, generate
from engine.models import load_drafter, load_target
from engine.tokenizer import load_tokenizer
from tests.helpers.tiny_qwen3 import save_tiny_dflash, save_tiny_qwen3

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    target = save_tiny_qwen3(root / "target", seed=31)
    return target, save_tiny_dflash(root / "draft", target, seed=32)


def run_json(capsys, argv: list[str]) -> dict:
    assert main(["generate", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_prompt_ids_json_matches_the_library(dirs, capsys):
    target_dir, draft_dir = dirs
    argv = ["--model", str(target_dir), "--draft", str(draft_dir), "--method", "ddtree"]
    doc = run_json(
        capsys, [*argv, "--budget", "4", "--prompt-ids", "3,7,9", "--max-new-tokens", "6"]
    )
    stop = load_tokenizer(target_dir).eos_token_ids
    expected = generate(
        load_target(target_dir),
        load_drafter(draft_dir),
        [3, 7, 9],
        GenerationConfig("ddtree", 4, 6, stop_token_ids=stop),
    )
    assert doc["output_ids"] == expected.output_ids
    assert doc["text"] == load_tokenizer(target_dir).decode(expected.output_ids)
    assert sum(doc["acceptance_lengths"]) == len(doc["output_ids"]) - 1
    assert set(doc["stage_seconds"]) == {"prefill", "draft", "tree", "verify", "commit"}
    assert doc["decode_tokens_per_s"] >= 0
    assert "rounds" not in doc


def test_prompt_text_and_trace(dirs, capsys):
    target_dir, draft_dir = dirs
    doc = run_json(
        capsys,
        ["--model", str(target_dir), "--draft", str(draft_dir), "--method", "ddtree"]
        + ["--budget", "5", "--prompt", "w1 w2 w3", "--max-new-tokens", "5", "--trace"],
    )
    ar = run_json(
        capsys,
        ["--model", str(target_dir), "--method", "ar", "--prompt-ids", "4,5,6"]
        + ["--max-new-tokens", "5", "--dtype", "float64", "--device", "cpu"],
    )
    assert doc["output_ids"] == ar["output_ids"]  # "w1 w2 w3" encodes to 4, 5, 6
    assert len(doc["rounds"]) == len(doc["acceptance_lengths"])
    for round_ in doc["rounds"]:
        tree = round_["tree"]
        assert len(tree["tokens"]) == len(tree["parents"]) <= 5
        assert all(0 <= p <= i for i, p in enumerate(tree["parents"]))
        assert all(1 <= a <= len(tree["tokens"]) for a in round_["accepted"])


def test_plain_output_and_usage_errors(dirs, capsys):
    target_dir, _ = dirs
    argv = ["generate", "--model", str(target_dir), "--method", "ar", "--prompt", "w1"]
    assert main([*argv, "--max-new-tokens", "3"]) == 0
    assert capsys.readouterr().out.strip().split(" ")[0].startswith("w")
    assert (
        main(["generate", "--model", str(target_dir), "--method", "linear", "--prompt", "w1"]) == 2
    )
    assert "needs --draft" in capsys.readouterr().err


def test_tokenizer_round_trip_chat_template_and_stop_ids(dirs):
    tok = load_tokenizer(dirs[0])
    assert tok.encode("w1 w2") == [4, 5]
    assert tok.decode([4, 5]) == "w1 w2"
    ids = tok.apply_chat_template([{"role": "user", "content": "w7"}])
    assert ids == tok.encode("<|im_start|> w0 w7 <|im_end|> <|im_start|> w0")  # roles are unknown
    assert tok.eos_token_ids == (2,)
