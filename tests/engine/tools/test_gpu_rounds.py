"""engine/tools/gpu_rounds.py on the CPU: its arithmetic, its arguments, its "needs CUDA" exit.

Run: python -m pytest -q tests/engine/tools/test_gpu_rounds.py
"""

from __future__ import annotations

import pytest
import torch

from engine.models.qwen3_5 import Qwen3_5Config, Qwen3_5Model
from engine.tools import gpu_rounds
from engine.tools.gpu_memory import stack_config


def test_the_floor_is_bytes_over_bandwidth_in_ms():
    assert gpu_rounds.floor_ms(54 * 10**9, 4.8e12) == pytest.approx(11.25)


def test_per_layer_fit_extends_the_line_through_two_runs():
    # 4 layers 10 ms, 8 layers 14 ms: 1 ms a layer on top of 6 ms
    assert gpu_rounds.per_layer_fit(10.0, 4, 14.0, 8, 64) == pytest.approx(70.0)


def test_step_bytes_count_weights_but_the_embedding_table_kv_and_gdn_state():
    config = Qwen3_5Config.from_hf(stack_config(4))
    with torch.device("meta"):
        model = Qwen3_5Model(config).to(torch.bfloat16)
    weights = sum(p.numel() for p in model.parameters()) * 2
    embedding = config.vocab_size * config.hidden_size * 2
    kv = 1 * 1000 * 2 * 4 * 256 * 2  # one attention layer of four
    state = 3 * 48 * 128 * 128 * 4  # three GDN layers, float32
    assert gpu_rounds.step_bytes(model, 1000) == weights - embedding + kv + state


def test_a_figure_prints_beside_its_target_and_says_whether_it_is_met():
    met = gpu_rounds.Figure("ar step / floor", 1.1, 1.2, "x")
    missed = gpu_rounds.Figure("host syncs per round", 4, 3)
    plain = gpu_rounds.Figure("ar step ms", 12.5, None, " ms")
    assert met.passed and "(target <= 1.2x)" in met.line() and met.line().endswith("ok")
    assert not missed.passed and missed.line().endswith("MISSED")
    assert plain.passed and "target" not in plain.line()


def test_arguments_are_checked():
    args = gpu_rounds.parse_args(["--layers", "2", "--prefix", "4096", "--json"])
    assert (args.layers, args.prefix, args.budget, args.json) == (2, 4096, 15, True)
    with pytest.raises(SystemExit) as exit_info:
        gpu_rounds.parse_args(["--layers", "0"])
    assert exit_info.value.code == 2


def test_without_cuda_it_says_so_in_one_line_and_exits_2(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_rounds.main([]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.strip().splitlines() == [
        "gpu_rounds: needs CUDA (no CUDA device here): nothing measured"
    ]


def test_steady_figures_leave_the_capturing_rounds_out():
    assert gpu_rounds.steady([900.0, 500.0, 11.0, 12.0, 10.0]) == 11.0


@pytest.mark.usefixtures("one_torch_thread")
def test_the_pooled_conversation_runs_its_turns_from_the_cache(tmp_path):
    """On the CPU (no graphs: nothing captured) the pooled conversation's plumbing: the last
    turn resumes from the cache; the figure is timed on a GPU."""
    from tests.helpers.tiny_pairs import load_tiny_pair

    target, drafter = load_tiny_pair(tmp_path, "hybrid")
    pooled = gpu_rounds.pooled_conversation(target, drafter, prefix=40, budget=4, turns=2)
    assert pooled["captures_after_first_turn"] == 0
    assert pooled["cached_tokens"] == 40 + gpu_rounds.NEW_TOKENS - 1  # turn 1's prompt + answer
    assert pooled["ttft_cold_ms"] > 0 and pooled["ttft_cached_ms"] > 0
