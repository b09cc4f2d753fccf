"""Sampling settings (engine/sampling.py): the warps and penalties as defined, and lossless under
speculation: greedy output with penalties equals `ar`'s, and ddtree's samples keep the target's
warped, penalised distribution.

Run: python -m pytest -q tests/engine/test_sampling.py
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from engine.decode import GenerationConfig, generate
from engine.models import load_drafter, load_target
from engine.sampling import Penalties, Sampling, greedy, warped_probs
from tests.helpers.exact_joint import joint_first_three, sampling_noise, total_variation
from tests.helpers.tiny_pairs import KINDS, load_tiny_pair
from tests.helpers.tiny_qwen3 import save_tiny_dflash, save_tiny_qwen3

QWEN_THINKING = Sampling(top_p=0.95, top_k=20, min_p=0.0, presence_penalty=1.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_greedy_is_argmax_the_first_of_equal_maxima(dtype):
    """The greedy choice is `argmax`'s, tie for tie: the first of equal maxima, NaN largest."""
    logits = torch.randint(0, 4, (500, 64), generator=torch.Generator().manual_seed(0)).to(dtype)
    logits[7, [5, 9]] = float("nan")
    assert torch.equal(greedy(logits), logits.argmax(dim=-1))
    assert greedy(logits)[7] == 5
    assert greedy(torch.tensor([1.0, 3.0, 3.0, 2.0], dtype=dtype)) == 1


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("top_p", -0.1),
        ("top_p", 1.5),
        ("top_k", -1),
        ("min_p", 1.1),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3),
        ("repetition_penalty", 0),
    ],
)
def test_a_value_out_of_range_is_refused_by_name(field, value):
    with pytest.raises(ValueError, match=field):
        Sampling(**{field: value})


def probs_of(row: list[float], sampling: Sampling) -> list[float]:
    logits = torch.tensor([row]).log()
    return [round(p, 4) for p in warped_probs(logits, sampling)[0].tolist()]


def test_the_defaults_ask_for_nothing():
    row = [0.5, 0.3, 0.15, 0.05]
    assert probs_of(row, Sampling()) == row and not Sampling().penalized
    assert probs_of(row, QWEN_THINKING) == [0.5263, 0.3158, 0.1579, 0.0]  # top_p 0.95 drops 0.05
    assert QWEN_THINKING.penalized


def test_warps_keep_what_each_defines():
    row = [0.5, 0.3, 0.15, 0.05]
    assert probs_of(row, Sampling(top_k=2)) == [0.625, 0.375, 0.0, 0.0]
    assert probs_of(row, Sampling(top_p=0.8)) == [0.625, 0.375, 0.0, 0.0]  # 0.5 + 0.3 reach it
    assert probs_of(row, Sampling(top_p=0.81)) == [0.5263, 0.3158, 0.1579, 0.0]
    assert probs_of(row, Sampling(top_p=0.1)) == [1.0, 0.0, 0.0, 0.0]  # the top one stays
    assert probs_of(row, Sampling(top_p=0.0)) == [1.0, 0.0, 0.0, 0.0]  # 0: it alone (greedy)
    assert probs_of(row, Sampling(min_p=0.4)) == [0.625, 0.375, 0.0, 0.0]  # >= 0.2 stays
    assert probs_of(row, Sampling(top_k=3, top_p=0.9)) == [0.5263, 0.3158, 0.1579, 0.0]


def test_penalties_count_the_output_and_each_rows_own_path():
    sampling = Sampling(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0)
    penalties = Penalties(sampling, 6, torch.device("cpu"))
    penalties.start([5])  # in the prompt: repetition only
    penalties.add([1, 1, 2])
    logits = torch.tensor([[1.0, 4.0, -2.0, 3.0, 0.0, 6.0]] * 2)
    out = penalties.apply(logits, [[], [3, 3]]).tolist()
    # token 1: 4 / 2 - 0.5 - 2 * 0.25; token 2: -2 * 2 - 0.5 - 0.25; token 5: 6 / 2 (prompt)
    assert out[0] == [1.0, 1.0, -4.75, 3.0, 0.0, 3.0]
    assert out[1] == [1.0, 1.0, -4.75, 3 / 2 - 0.5 - 0.5, 0.0, 3.0]  # its path holds 3 twice


@pytest.fixture(scope="module", params=KINDS)
def pair(request, tmp_path_factory):
    return load_tiny_pair(tmp_path_factory.mktemp(request.param), request.param)


def test_greedy_with_penalties_is_the_same_for_every_method(pair):
    target, drafter = pair
    sampling = Sampling(presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.3)
    for prompt in ([5, 9, 17, 4], [30, 8, 2, 2, 7]):
        plain = generate(target, None, prompt, GenerationConfig("ar", max_new_tokens=40))
        outputs = {
            (method, budget): generate(
                target,
                None if method == "ar" else drafter,
                prompt,
                GenerationConfig(method, budget, max_new_tokens=40, sampling=sampling),
            ).output_ids
            for method, budget in [("ar", 0), ("linear", 0), ("ddtree", 4), ("ddtree", 15)]
        }
        assert all(out == outputs[("ar", 0)] for out in outputs.values()), outputs
        assert outputs[("ar", 0)] != plain.output_ids  # the penalties did move the argmax
        assert max(Counter(outputs[("ar", 0)]).values()) < max(Counter(plain.output_ids).values())


def reference_rule(prompt: list[int], sampling: Sampling, temperature: float):
    """The warped, penalised next-token distribution written out plainly (numpy, one row)."""

    def probs(logits: torch.Tensor, output: list[int]) -> torch.Tensor:
        x = logits.double().numpy().copy()
        for token in set(prompt) | set(output):
            x[token] = (
                x[token] / sampling.repetition_penalty
                if x[token] > 0
                else x[token] * sampling.repetition_penalty
            )
        for token, count in Counter(output).items():
            x[token] -= sampling.presence_penalty + sampling.frequency_penalty * count
        x = x / temperature
        if sampling.top_k:
            x[np.argsort(-x)[sampling.top_k :]] = -np.inf
        p = np.exp(x - x.max())
        p /= p.sum()
        kept, mass = [], 0.0
        for token in np.argsort(-p, kind="stable"):
            if mass >= sampling.top_p:
                break
            kept.append(token)
            mass += p[token]
        p[[t for t in range(len(p)) if t not in kept]] = 0
        p[p < sampling.min_p * p.max()] = 0
        return torch.from_numpy(p / p.sum())

    return probs


def test_sampled_ddtree_keeps_the_warped_penalised_distribution(tmp_path):
    """Temperature 0.9 with Qwen-style warps and all three penalties: the first three tokens'
    frequencies over 300 seeded runs vs the exact joint. Tolerance: twice sampling noise's
    expected total variation; ignoring the penalties (or counting a node's path wrongly)
    moves the joint by several times that (checked)."""
    vocab, runs, temperature = 8, 300, 0.9
    target_dir = save_tiny_qwen3(tmp_path / "t", seed=21, vocab_size=vocab, tokenizer=False)
    target = load_target(target_dir)
    with torch.no_grad():
        target.lm_head.weight.mul_(25)
    drafter = load_drafter(save_tiny_dflash(tmp_path / "d", target_dir, seed=22, block_size=4))
    prompt = [1, 5, 3]
    warps = dict(top_k=6, top_p=0.9, min_p=0.05)
    sampling = Sampling(**warps, presence_penalty=1.5, frequency_penalty=1, repetition_penalty=1.5)
    exact = joint_first_three(target, prompt, reference_rule(prompt, sampling, temperature))
    unpenalised = Sampling(**warps)
    plain = joint_first_three(target, prompt, reference_rule(prompt, unpenalised, temperature))
    noise = sampling_noise(exact, runs)
    assert total_variation({k: round(p * 1e6) for k, p in plain.items()}, exact) > 4 * noise
    for method, budget in [("ar", 0), ("ddtree", 6)]:
        counts: dict[tuple[int, ...], int] = {}
        accepted = 0
        for seed in range(runs):
            cfg = GenerationConfig(
                method, budget, 3, temperature=temperature, seed=seed, sampling=sampling
            )
            result = generate(target, drafter, prompt, cfg)
            key = tuple(result.output_ids)
            counts[key] = counts.get(key, 0) + 1
            accepted += result.acceptance_lengths[0] - 1
        assert set(counts) <= set(exact)  # nothing the warps cut
        assert total_variation(counts, exact) < 2 * noise, method
        if method == "ddtree":
            assert accepted > runs // 5  # the tree really carried accepted tokens
