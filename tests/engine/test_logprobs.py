"""Logprobs (engine/sampling.py's choose_scored, PromptScores; engine/decode.py's hook): each
output token's logprob is the target's at its own path under the request's mask, penalties and
warps, identical across ar, linear and ddtree; the prompt's are every position's log-softmax,
chunk by chunk. Float64 tiny pairs on the CPU, checked against one teacher-forced pass.

Run: python -m pytest -q tests/engine/test_logprobs.py
"""

from __future__ import annotations

import math

import pytest
import torch

from engine.decode import GenerationConfig, generate
from engine.grammar import Constraint
from engine.models import common
from engine.sampling import (
    Sampling,
    choose_scored,
    read_scored,
    read_scored_together,
    warped_probs,
)
from tests.helpers.tiny_grammar import STOP, char_tokenizer
from tests.helpers.tiny_grammar import _char_words as char_words
from tests.helpers.tiny_pairs import KINDS, load_tiny_pair

PROMPT = [5, 9, 17, 4, 30, 8, 11]
METHODS = [("ar", 0), ("linear", 0), ("ddtree", 6)]
TOL = 1e-9


@pytest.fixture(scope="module", params=KINDS)
def pair(request, tmp_path_factory):
    return load_tiny_pair(
        tmp_path_factory.mktemp(request.param), request.param, dtype=torch.float64
    )


def run(pair, method: str, budget: int, **cfg):
    target, drafter = pair
    config = GenerationConfig(method=method, budget=budget, **cfg)
    return generate(target, None if method == "ar" else drafter, PROMPT, config)


def teacher_forced(target, ids: list[int]) -> torch.Tensor:  # [len(ids), V] float64 logits
    cache = target.new_cache(len(ids) + 4)
    logits, _ = target.forward(torch.tensor(ids), cache)
    return logits


def reference_logprobs(target, output: list[int], temperature: float, sampling: Sampling):
    """The log-probability of each output token under its row's distribution, with no cache
    reuse, no tree, no speculation: one forward over the prompt and the output."""
    logits = teacher_forced(target, PROMPT + output)[len(PROMPT) - 1 : -1]
    if sampling.presence_penalty:  # counts of the output before each row
        for row in range(len(output)):
            seen = torch.zeros(logits.shape[-1], dtype=torch.bool)
            seen[output[:row]] = True
            logits[row] -= sampling.presence_penalty * seen
    if temperature == 0:
        return logits.log_softmax(-1)
    scaled = logits.float() / temperature
    probs = warped_probs(scaled, sampling)
    return scaled.masked_fill(probs == 0, float("-inf")).log_softmax(-1)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_each_tokens_logprob_is_the_targets_at_its_path_under_every_method(pair, temperature):
    target, _ = pair
    sampling = Sampling(top_p=0.9, top_k=8, presence_penalty=0.5)
    results = {}
    for method, budget in METHODS:
        cfg = dict(max_new_tokens=20, temperature=temperature, seed=4, sampling=sampling)
        result = run(pair, method, budget, logprobs=5, **cfg)
        assert [entry.token for entry in result.logprobs] == result.output_ids
        reference = reference_logprobs(target, result.output_ids, temperature, sampling)
        for row, entry in enumerate(result.logprobs):
            assert math.isclose(entry.logprob, reference[row, entry.token], abs_tol=TOL)
            values, ids = reference[row].topk(5)
            assert [token for token, _ in entry.top] == ids.tolist()
            assert [v for _, v in entry.top] == pytest.approx(values.tolist(), abs=TOL)
        if temperature == 0:
            assert all(entry.top[0][0] == entry.token for entry in result.logprobs)
        results[method] = result
    if temperature == 0:  # the same tokens: the same logprobs, to float tolerance
        ar = results["ar"]
        for method in ("linear", "ddtree"):
            assert results[method].output_ids == ar.output_ids
            got = [entry.logprob for entry in results[method].logprobs]
            assert got == pytest.approx([entry.logprob for entry in ar.logprobs], abs=TOL)


def test_logprobs_change_no_token(pair):
    for method, budget in METHODS:
        cfg = dict(max_new_tokens=16, temperature=0.9, seed=11)
        plain = run(pair, method, budget, **cfg)
        scored = run(pair, method, budget, logprobs=0, **cfg)
        assert scored.output_ids == plain.output_ids
        assert plain.logprobs is None
        assert all(entry.top == () for entry in scored.logprobs)


def test_a_stop_token_cuts_the_logprobs_with_the_output(pair):
    stop = run(pair, "ar", 0, max_new_tokens=12).output_ids[4]
    for method, budget in METHODS:
        result = run(pair, method, budget, max_new_tokens=12, stop_token_ids=(stop,), logprobs=1)
        assert len(result.logprobs) == len(result.output_ids) <= 5


def test_logprobs_under_a_grammar_are_of_the_masked_distribution(pair):
    target, drafter = pair
    vocab = target.lm_head.weight.shape[0]
    constraint = Constraint.from_lark(char_tokenizer(vocab), "start: /[a-c]{4,8}/")
    words = ["<stop>", *char_words(vocab)]  # id 0 is the stop token
    allowed = {i for i, word in enumerate(words) if set(word) <= set("abc")} | {STOP}
    for method, budget in METHODS:
        cfg = GenerationConfig(
            method, budget, max_new_tokens=10, stop_token_ids=(STOP,), constraint=constraint
        )
        cfg.logprobs = 20  # more than the grammar allows: the rest are -inf
        result = generate(target, None if method == "ar" else drafter, PROMPT, cfg)
        for entry in result.logprobs:
            finite = {token for token, value in entry.top if value > -math.inf}
            assert finite <= allowed and entry.token in finite
            assert math.isclose(sum(math.exp(v) for _, v in entry.top), 1.0, abs_tol=1e-9)


def test_top_p_zero_keeps_the_most_likely_token_alone():
    logits = torch.tensor([[0.1, 2.0, 1.0], [3.0, 0.0, 2.9]])
    choices, scores = choose_scored(
        logits, 1.0, torch.Generator().manual_seed(1), Sampling(top_p=0.0), 2
    )
    tokens, logprobs = read_scored(choices, scores)
    assert tokens == [1, 0]
    assert [entry.logprob for entry in logprobs] == [0.0, 0.0]
    assert [entry.top[1][1] for entry in logprobs] == [-math.inf, -math.inf]


def test_a_batched_steps_choices_and_logprobs_are_each_sequences_own_in_one_read():
    """Sequences of different lengths, some asking logprobs (at different tops) and some not,
    read together give what each one's own read gives, float32 logprobs to the bit."""
    generator = torch.Generator().manual_seed(4)
    scored = [
        choose_scored(torch.randn(T, 300, generator=generator), 0.0, None, Sampling(), top)
        for T, top in ((3, 2), (1, None), (5, 0), (2, 7), (4, None))
    ]
    assert scored[1][1] is None and scored[2][1] is not None
    assert read_scored_together(scored) == [read_scored(*one) for one in scored]
    plain = [one for one in scored if one[1] is None]
    assert read_scored_together(plain) == [read_scored(*one) for one in plain]
    assert read_scored_together([]) == []


@pytest.mark.parametrize("method", ["ar", "ddtree"])
def test_the_prompts_logprobs_are_every_positions_chunk_by_chunk(pair, monkeypatch, method):
    target, _ = pair
    monkeypatch.setattr(common, "SCORE_ROWS", 2)  # slices inside chunks, chunks of 3
    result = run(pair, method, 6, max_new_tokens=3, prompt_logprobs=4, prefill_chunk=3)
    reference = teacher_forced(target, PROMPT).log_softmax(-1)
    assert result.prompt_logprobs[0] is None
    assert len(result.prompt_logprobs) == len(PROMPT)
    for position, entry in enumerate(result.prompt_logprobs[1:], 1):
        assert entry.token == PROMPT[position]
        assert math.isclose(entry.logprob, reference[position - 1, entry.token], abs_tol=TOL)
        assert [token for token, _ in entry.top] == reference[position - 1].topk(4).indices.tolist()
    plain = run(pair, method, 6, max_new_tokens=3)
    assert result.output_ids == plain.output_ids and plain.prompt_logprobs is None


def test_logprobs_beyond_twenty_are_refused(pair):
    with pytest.raises(ValueError, match="logprobs"):
        run(pair, "ar", 0, max_new_tokens=2, logprobs=21)


def test_a_logit_bias_moves_every_methods_choice_and_its_logprob(pair):
    favoured = run(pair, "ar", 0, max_new_tokens=2).output_ids[0] + 1
    sampling = Sampling(logit_bias=((favoured, 100.0),))
    for method, budget in METHODS:
        result = run(pair, method, budget, max_new_tokens=6, sampling=sampling, logprobs=1)
        assert result.output_ids == [favoured] * 6
        assert all(entry.logprob > -1e-6 for entry in result.logprobs)  # it is all the mass
    with pytest.raises(ValueError, match="logit_bias"):
        Sampling(logit_bias=((favoured, 101.0),))
