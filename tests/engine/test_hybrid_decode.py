"""engine.decode.generate on the hybrid target: ar = transformers, linear/ddtree = ar, lossless sampling.

    python -m pytest -q tests/engine/test_hybrid_decode.py

A tiny random Qwen3.5 target with an 8-token vocabulary (so a ddtree's first levels cover most
tokens and rounds accept several tokens, exercising the GDN state commit of long paths) and a
tiny random DFlash drafter. Speculative runs use float64, where no two logits tie by accident.
"""

from __future__ import annotations

import pytest
import torch

from engine.decode import GenerationConfig, generate
from engine.models import load_drafter, load_target
from tests.helpers.tiny_hybrid import (
    build_tiny_hybrid,
    save_tiny_hybrid,
    save_tiny_hybrid_drafter,
)

VOCAB = 8
TARGET = dict(  # one GDN + one attention layer; peaked logits, so greedy has no near-ties
    vocab_size=VOCAB,
    initializer_range=0.3,
    num_hidden_layers=2,
    layer_types=["linear_attention", "full_attention"],
)
SPECULATIVE = [("linear", 0), ("ddtree", 1), ("ddtree", 4), ("ddtree", 15), ("ddtree", 64)]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid-pair")
    target = save_tiny_hybrid(root / "target", seed=5, **TARGET)
    drafter = save_tiny_hybrid_drafter(
        root / "draft", target, seed=6, num_layers=1, target_layer_ids=(0, 1)
    )
    return target, drafter


def random_prompts(count: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 7, (count,), generator=generator)
    return [torch.randint(3, VOCAB, (int(n),), generator=generator).tolist() for n in lengths]


def test_greedy_ar_equals_transformers_generate(pair_dirs):
    target = load_target(pair_dirs[0])
    reference = build_tiny_hybrid(seed=5, **TARGET)
    for prompt in random_prompts(3, seed=0):
        ours = generate(target, None, prompt, GenerationConfig(method="ar", max_new_tokens=10))
        with torch.no_grad():
            theirs = reference.generate(
                torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=None
            )[0, len(prompt) :].tolist()
        assert ours.output_ids == theirs


def assert_speculative_equals_ar(pair_dirs, cases: list[tuple[list[int], str, int]]) -> None:
    """Each (prompt, method, budget) generates exactly ar's tokens; some rounds accept >= 3."""
    target = load_target(pair_dirs[0], dtype=torch.float64)
    drafter = load_drafter(pair_dirs[1], dtype=torch.float64)
    expected: dict[tuple[int, ...], list[int]] = {}
    longest_round = 0
    for prompt, method, budget in cases:
        if tuple(prompt) not in expected:
            cfg = GenerationConfig(method="ar", max_new_tokens=8)
            expected[tuple(prompt)] = generate(target, None, prompt, cfg).output_ids
        cfg = GenerationConfig(method=method, budget=budget, max_new_tokens=8)
        result = generate(target, drafter, prompt, cfg)
        assert result.output_ids == expected[tuple(prompt)], (prompt, method, budget)
        longest_round = max(longest_round, *result.acceptance_lengths)
    assert longest_round >= 3  # some rounds committed paths of several drafted tokens


def test_linear_and_ddtree_equal_ar_each_method_on_4_of_20_prompts(pair_dirs):
    prompts = random_prompts(20, seed=1)
    cases = [(p, *SPECULATIVE[i % len(SPECULATIVE)]) for i, p in enumerate(prompts)]
    assert_speculative_equals_ar(pair_dirs, cases)


@pytest.mark.slow
def test_linear_and_ddtree_equal_ar_every_method_on_20_prompts(pair_dirs):
    prompts = random_prompts(20, seed=2)
    assert_speculative_equals_ar(pair_dirs, [(p, *m) for p in prompts for m in SPECULATIVE])


def sampling_config(seed: int, **changes) -> GenerationConfig:
    settings = dict(method="ddtree", budget=15, max_new_tokens=3, temperature=1.0, seed=seed)
    return GenerationConfig(**{**settings, **changes})


def test_sampling_is_seedable(pair_dirs):
    target = load_target(pair_dirs[0], dtype=torch.float64)
    drafter = load_drafter(pair_dirs[1], dtype=torch.float64)
    prompt = [5, 6]
    outputs = {
        seed: generate(target, drafter, prompt, sampling_config(seed, max_new_tokens=6)).output_ids
        for seed in range(4)
    }
    for seed in (0, 3):
        again = generate(target, drafter, prompt, sampling_config(seed, max_new_tokens=6))
        assert again.output_ids == outputs[seed]
    assert len({tuple(o) for o in outputs.values()}) > 1  # the seed does change the samples


@pytest.mark.slow
def test_ddtree_sampling_matches_the_target_distribution(pair_dirs):
    """Temperature 1: the 3rd token's frequencies under ddtree match its exact marginal.

    The 3rd token is sampled at a tree node (its path's GDN state) whenever the 2nd was drafted.
    Tolerance: twice the total variation expected from sampling noise alone.
    """
    target = load_target(pair_dirs[0], dtype=torch.float64)
    drafter = load_drafter(pair_dirs[1], dtype=torch.float64)
    prompt, runs = [5, 6], 400
    counts = torch.zeros(VOCAB, dtype=torch.float64)
    for seed in range(runs):
        counts[generate(target, drafter, prompt, sampling_config(seed)).output_ids[2]] += 1
    exact = third_token_marginal(target, prompt)
    noise = 0.5 * torch.sqrt(2 * exact * (1 - exact) / (torch.pi * runs)).sum().item()
    total_variation = 0.5 * (counts / runs - exact).abs().sum().item()
    assert total_variation < 2 * noise, (total_variation, noise)


def next_token_probs(target, ids: list[int]) -> torch.Tensor:  # [V]
    cache = target.new_cache(len(ids))
    logits, _ = target.forward(torch.tensor(ids), cache)
    return torch.softmax(logits[-1].double(), dim=-1)


def third_token_marginal(target, prompt: list[int]) -> torch.Tensor:  # [V]
    """P(x3 | prompt) = sum over x1, x2 of P(x1) P(x2 | x1) P(x3 | x1, x2)."""
    marginal = torch.zeros(VOCAB, dtype=torch.float64)
    first = next_token_probs(target, prompt)
    for x1 in range(VOCAB):
        second = next_token_probs(target, prompt + [x1])
        for x2 in range(VOCAB):
            weight = first[x1] * second[x2]
            if weight > 1e-6:
                marginal += weight * next_token_probs(target, prompt + [x1, x2])
    return marginal
