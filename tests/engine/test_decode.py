"""The round loop (engine/decode.py): ar == transformers, linear/ddtree == ar, exact limits, sampling.

Besides the random z-lab-layout drafter, an `OracleDrafter` proposes the target's own greedy
continuation (optionally at rank 1 or not at all at some positions), so multi-token acceptance,
branching and misses are all exercised.

Run: python -m pytest -q tests/engine/test_decode.py
"""

from __future__ import annotations

import random

import pytest
import torch

from engine.decode import GenerationConfig, generate
from engine.models import load_drafter, load_target
from tests.helpers.oracle_drafter import OracleDrafter
from tests.helpers.tiny_qwen3 import save_tiny_dflash, save_tiny_qwen3

torch.set_num_threads(1)

SPECULATIVE = [("linear", 15), ("ddtree", 1), ("ddtree", 4), ("ddtree", 15), ("ddtree", 64)]
MAX_NEW = 10


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_qwen3(tmp_path_factory.mktemp("target"), seed=11, tokenizer=False)


@pytest.fixture(scope="module")
def target(model_dir):
    return load_target(model_dir)


@pytest.fixture(scope="module")
def drafter(model_dir, tmp_path_factory):
    return load_drafter(save_tiny_dflash(tmp_path_factory.mktemp("draft"), model_dir, seed=12))


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(96) for _ in range(rng.randrange(1, 12))] for _ in range(20)]


@pytest.fixture(scope="module")
def ar_outputs(target, prompts) -> list[list[int]]:
    cfg = GenerationConfig(method="ar", max_new_tokens=MAX_NEW)
    return [generate(target, None, p, cfg).output_ids for p in prompts]


def noisy_oracle(prompt: list[int], output: list[int], seed: int) -> OracleDrafter:
    sequence = prompt + output
    rng = random.Random(seed)
    ranks = {p: rng.choice([0, 0, 0, 1, None]) for p in range(len(sequence))}
    return OracleDrafter(sequence, 96, ranks=ranks)


def test_ar_equals_transformers_greedy_generate(model_dir, prompts, ar_outputs):
    from transformers import Qwen3ForCausalLM

    hf = Qwen3ForCausalLM.from_pretrained(model_dir).eval()
    hf.generation_config.eos_token_id = None
    for prompt, ours in zip(prompts, ar_outputs, strict=True):
        with torch.no_grad():
            ids = torch.tensor([prompt])
            out = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),  # else token 0 (= pad id) would be masked
                max_new_tokens=MAX_NEW,
                do_sample=False,
                pad_token_id=0,
            )
        assert out[0, len(prompt) :].tolist() == ours


@pytest.mark.parametrize(("method", "budget"), SPECULATIVE)
def test_greedy_speculative_output_equals_ar(target, drafter, prompts, ar_outputs, method, budget):
    cfg = GenerationConfig(method=method, budget=budget, max_new_tokens=MAX_NEW)
    for i, (prompt, expected) in enumerate(zip(prompts, ar_outputs, strict=True)):
        use = drafter if i % 4 == 0 else noisy_oracle(prompt, expected, seed=i)
        result = generate(target, use, prompt, cfg)
        assert result.output_ids == expected, (i, method, budget)
        assert sum(result.acceptance_lengths) == MAX_NEW - 1  # the prefill gives the first
        assert result.finish_reason == "length"


@pytest.mark.parametrize(("method", "budget"), [("linear", 15), ("ddtree", 3), ("ddtree", 15)])
def test_a_correct_drafter_is_accepted_for_whole_blocks(
    target, prompts, ar_outputs, method, budget
):
    prompt = prompts[1]
    expected = ar_outputs[1]
    oracle = OracleDrafter(prompt + expected, 96, block_size=3)
    cfg = GenerationConfig(method=method, budget=budget, max_new_tokens=1 + 3 * 3, trace=True)
    result = generate(target, oracle, prompt, cfg)
    assert result.output_ids == expected
    assert result.acceptance_lengths == [3, 3, 3]
    assert all(len(r["accepted"]) == 2 for r in result.rounds)


def test_ddtree_recovers_second_choices_that_a_chain_misses(target, prompts, ar_outputs):
    prompt, expected = prompts[2], ar_outputs[2]
    ranks = dict.fromkeys(range(len(prompt) + len(expected)), 1)  # always second choice
    oracle = OracleDrafter(prompt + expected, 96, block_size=3, ranks=ranks)
    chain = generate(target, oracle, prompt, GenerationConfig("linear", max_new_tokens=MAX_NEW))
    tree = generate(target, oracle, prompt, GenerationConfig("ddtree", 15, max_new_tokens=MAX_NEW))
    assert chain.output_ids == tree.output_ids == expected
    assert set(chain.acceptance_lengths) == {1}
    assert max(tree.acceptance_lengths) == 3


@pytest.mark.parametrize(("method", "budget"), [("ar", 0), *SPECULATIVE])
def test_stop_token_ends_output_right_after_it(target, prompts, ar_outputs, method, budget):
    prompt, expected = prompts[3], ar_outputs[3]
    stop_at = next(i for i in range(2, MAX_NEW) if expected[i] not in expected[:i])
    oracle = OracleDrafter(prompt + expected, 96, block_size=4)
    cfg = GenerationConfig(method, budget, MAX_NEW, stop_token_ids=(expected[stop_at],))
    result = generate(target, oracle, prompt, cfg)
    assert result.output_ids == expected[: stop_at + 1]
    assert result.finish_reason == "stop"


@pytest.mark.parametrize(("method", "budget"), [("ar", 0), *SPECULATIVE])
def test_cache_limit_is_exact_and_never_overrun(target, prompts, ar_outputs, method, budget):
    prompt, expected = prompts[4], ar_outputs[4]
    oracle = OracleDrafter(prompt + expected, 96, block_size=4)
    cfg = GenerationConfig(method, budget, MAX_NEW)
    # 5 more tokens fit in the cache; the last round's bonus is output without being cached.
    # KVCache raises on any write past max_len, so finishing at all proves no overrun.
    result = generate(target, oracle, prompt, cfg, max_len=len(prompt) + 5)
    assert result.output_ids == expected[:6]
    assert result.finish_reason == "length"


def test_tokens_stream_in_order_and_cancel_stops_the_loop(target, prompts, ar_outputs):
    prompt, expected = prompts[5], ar_outputs[5]
    oracle = OracleDrafter(prompt + expected, 96, block_size=4)
    streamed: list[list[int]] = []
    polls = iter([False, False, True])
    result = generate(
        target,
        oracle,
        prompt,
        GenerationConfig("ddtree", 8, MAX_NEW),
        on_tokens=streamed.append,
        should_stop=lambda: next(polls),
    )
    assert result.finish_reason == "cancelled"
    assert [t for chunk in streamed for t in chunk] == result.output_ids
    assert len(streamed) == 3  # prefill, then two rounds before the stop was seen
    assert result.output_ids == expected[: len(result.output_ids)]
    assert set(result.stage_seconds) == {"prefill", "draft", "tree", "verify", "commit"}


def test_bad_configurations_are_refused(target):
    with pytest.raises(ValueError, match="needs a drafter"):
        generate(target, None, [1, 2], GenerationConfig(method="ddtree"))
    with pytest.raises(ValueError, match="method"):
        generate(target, None, [1, 2], GenerationConfig(method="beam"))
    with pytest.raises(ValueError, match="does not fit"):
        generate(target, None, [1] * 9, GenerationConfig(method="ar"), max_len=8)


def joint_first_three(target, prompt: list[int]) -> dict[tuple[int, ...], float]:
    """Exact P(t1, t2, t3) of the target at temperature 1."""
    cache = target.new_cache(len(prompt) + 2)
    logits, _ = target.forward(torch.tensor(prompt), cache)
    target.commit(cache, torch.arange(len(prompt)))
    first = torch.softmax(logits[-1], -1)  # [V]
    vocab = first.shape[0]
    joint = {}
    for t1 in range(vocab):
        for t2 in range(vocab):
            pending, _ = target.forward(torch.tensor([t1, t2]), cache)  # not committed
            second, third = torch.softmax(pending, -1)  # P(t2 | t1), P(t3 | t1, t2)
            for t3 in range(vocab):
                joint[(t1, t2, t3)] = float(first[t1] * second[t2] * third[t3])
    return joint


def test_temperature_one_ddtree_samples_the_targets_distribution(tmp_path):
    """Empirical P(first three tokens) over 200 seeded runs vs the exact one: total variation.

    The third token comes from a tree node's sample whenever a draft is accepted. Tolerance
    0.15: sampling noise at 200 draws gives about 0.08 here (for ar and ddtree alike); a walk
    that committed draft tokens instead of the target's samples lands far beyond it.
    """
    vocab, runs = 8, 200
    target_dir = save_tiny_qwen3(tmp_path / "t", seed=21, vocab_size=vocab, tokenizer=False)
    target = load_target(target_dir)
    with torch.no_grad():
        target.lm_head.weight.mul_(40)  # a peaked, non-uniform distribution
    drafter = load_drafter(save_tiny_dflash(tmp_path / "d", target_dir, seed=22, block_size=4))
    prompt = [1, 5, 3]
    exact = joint_first_three(target, prompt)
    for method, budget in [("ar", 0), ("ddtree", 6)]:
        counts: dict[tuple[int, ...], int] = {}
        accepted_drafts = 0
        for seed in range(runs):
            cfg = GenerationConfig(method, budget, max_new_tokens=3, temperature=1.0, seed=seed)
            result = generate(target, drafter, prompt, cfg)
            key = tuple(result.output_ids)
            counts[key] = counts.get(key, 0) + 1
            accepted_drafts += result.acceptance_lengths[0] - 1
        tv = 0.5 * sum(abs(counts.get(k, 0) / runs - p) for k, p in exact.items())
        assert tv <= 0.15, (method, tv)
        if method == "ddtree":
            assert accepted_drafts > runs // 4  # the tree really carried accepted tokens
