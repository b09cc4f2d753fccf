"""Constrained decoding (engine/grammar.py) inside every method: the output follows the grammar,
equals `ar` under the same grammar token for token (greedy) and keeps the target's constrained
distribution (sampled); draft trees hold grammar-valid tokens only; the demo pair, which
babbles, returns schema-valid JSON.

Run: python -m pytest -q tests/engine/test_grammar.py
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import llguidance
import numpy as np
import pytest
import torch

from engine.decode import GenerationConfig, generate
from engine.grammar import Constraint, Guide, mask_logits, tokenizer_from_json
from engine.models import load_drafter, load_target
from engine.tokenizer import load_tokenizer
from tests.helpers.exact_joint import joint_first_three, sampling_noise, total_variation
from tests.helpers.oracle_drafter import OracleDrafter
from tests.helpers.tiny_grammar import STOP, char_tokenizer, spell
from tests.helpers.tiny_pairs import KINDS, load_tiny_pair
from tests.helpers.tiny_qwen3 import save_tiny_dflash, save_tiny_qwen3

DEMO = Path(__file__).resolve().parents[2] / "engine" / "demo_model"
SCHEMA = {  # every field bounded: a random model's JSON must end
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "ok": {"type": "boolean"},
        "size": {"enum": [1, 22, 333]},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "ok", "size", "tags"],
    "additionalProperties": False,
}
METHODS = [("ar", 0), ("linear", 0), ("ddtree", 4), ("ddtree", 15)]


@pytest.fixture(scope="module", params=KINDS)
def tiny(request, tmp_path_factory):
    target, drafter = load_tiny_pair(tmp_path_factory.mktemp(request.param), request.param)
    vocab = target.lm_head.weight.shape[0]
    return target, drafter, Constraint.from_json_schema(char_tokenizer(vocab), SCHEMA), vocab


def constrained(method: str, budget: int, constraint, **options) -> GenerationConfig:
    return GenerationConfig(
        method, budget, constraint=constraint, stop_token_ids=(STOP,), **options
    )


def test_every_method_writes_the_same_schema_valid_json(tiny):
    target, drafter, constraint, vocab = tiny
    for prompt in ([5, 9, 17, 4], [30, 8, 2, 2, 7]):
        outputs = {}
        for method, budget in METHODS:
            cfg = constrained(method, budget, constraint, max_new_tokens=80)
            result = generate(target, None if method == "ar" else drafter, prompt, cfg)
            assert result.finish_reason == "stop" and result.output_ids[-1] == STOP
            outputs[(method, budget)] = result.output_ids
        assert all(out == outputs[("ar", 0)] for out in outputs.values()), outputs
        jsonschema.validate(json.loads(spell(outputs[("ar", 0)], vocab)), SCHEMA)


def test_an_oracle_tree_is_accepted_deep_under_the_grammar(tiny):
    """The target's own constrained continuation, drafted at rank 0 or behind a wrong token
    (which the grammar may refuse), is accepted for many tokens a round; output == ar."""
    target, _, constraint, _ = tiny
    prompt = [5, 9, 17, 4]
    cfg = constrained("ar", 0, constraint, max_new_tokens=80)
    expected = generate(target, None, prompt, cfg).output_ids
    ranks = {p: 1 for p in range(len(prompt), len(prompt) + len(expected), 3)}
    oracle = OracleDrafter(prompt + expected, target.lm_head.weight.shape[0], 5, ranks)
    result = generate(
        target, oracle, prompt, constrained("ddtree", 8, constraint, max_new_tokens=80)
    )
    assert result.output_ids == expected
    assert max(result.acceptance_lengths) >= 4


def test_draft_trees_hold_only_grammar_valid_tokens(tiny):
    target, drafter, constraint, _ = tiny
    cfg = constrained("ddtree", 15, constraint, max_new_tokens=80, trace=True)
    result = generate(target, drafter, [5, 9, 17, 4], cfg)
    output, nodes = result.output_ids[:1], 0
    for round_, taken in zip(result.rounds, result.acceptance_lengths, strict=True):
        tokens, parents = round_["tree"]["tokens"], round_["tree"]["parents"]
        paths: list[list[int]] = [[]]
        for parent, token in zip(parents, tokens, strict=True):
            paths.append([*paths[parent], token])
            fresh = llguidance.LLMatcher(constraint.tokenizer, constraint.grammar)
            assert fresh.consume_tokens(output)
            assert _valid_after(fresh, paths[-1], constraint.stop_token_ids), paths[-1]
        nodes += len(tokens)
        output = result.output_ids[: len(output) + taken]
    assert nodes > len(result.rounds)  # the trees were not empty


def _valid_after(matcher: llguidance.LLMatcher, path: list[int], stops: tuple[int, ...]) -> bool:
    *body, last = path
    if not matcher.consume_tokens(body):
        return False
    return matcher.is_accepting() if last in stops else matcher.validate_tokens([last]) == 1


def test_sampled_constrained_ddtree_keeps_the_targets_distribution(tmp_path):
    """Temperature 1 under a grammar: the first three tokens' frequencies over 300 seeded runs
    vs the exact masked-softmax joint. Tolerance: twice the total variation that sampling noise
    alone gives (~0.05 here); a draft token committed instead of the target's masked sample, or
    a mask taken at the wrong node, lands beyond it."""
    vocab, runs = 8, 300  # ids: stop, then a..g
    target_dir = save_tiny_qwen3(tmp_path / "t", seed=21, vocab_size=vocab, tokenizer=False)
    target = load_target(target_dir)
    with torch.no_grad():
        target.lm_head.weight.mul_(30)  # peaked: few likely sequences, little noise
    drafter = load_drafter(save_tiny_dflash(tmp_path / "d", target_dir, seed=22, block_size=4))
    constraint = Constraint.from_lark(char_tokenizer(vocab), "start: /[abc][a-e]{0,4}g/")
    prompt = [1, 5, 3]

    def masked(logits: torch.Tensor, output: list[int]) -> torch.Tensor:
        guide = Guide(constraint)
        for token in output:
            guide.advance([0], token)
        masks = torch.from_numpy(guide.masks(1))
        return torch.softmax(mask_logits(logits[None].double(), masks)[0], dim=-1)

    exact = joint_first_three(target, prompt, masked)
    assert len(exact) > 20  # the grammar leaves many sequences
    for method, budget in [("ar", 0), ("ddtree", 6)]:
        counts: dict[tuple[int, ...], int] = {}
        accepted = 0
        for seed in range(runs):
            cfg = constrained(
                method, budget, constraint, max_new_tokens=3, temperature=1.0, seed=seed
            )
            result = generate(target, drafter, prompt, cfg)
            key = tuple(result.output_ids)
            counts[key] = counts.get(key, 0) + 1
            accepted += result.acceptance_lengths[0] - 1
        assert set(counts) <= set(exact)  # never a token the grammar refuses
        assert total_variation(counts, exact) < 2 * sampling_noise(exact, runs), method
        if method == "ddtree":
            assert accepted > runs // 5  # the tree really carried accepted tokens


def test_masks_unpack_token_by_token():
    logits = torch.zeros(2, 70)
    masks = np.zeros((2, 3), np.int32)
    masks[0, 0], masks[0, 2] = 1 << 3, 1 << 5  # tokens 3 and 69
    masks[1, 1] = np.int32(-(2**31))  # bit 31 of word 1: token 63
    allowed = torch.isfinite(mask_logits(logits, torch.from_numpy(masks)))
    assert allowed[0].nonzero().flatten().tolist() == [3, 69]
    assert allowed[1].nonzero().flatten().tolist() == [63]


def test_a_grammar_whose_stop_tokens_do_not_stop_generation_is_refused(tiny):
    target, drafter, constraint, _ = tiny
    cfg = GenerationConfig("ddtree", 4, constraint=constraint, stop_token_ids=(1,))
    with pytest.raises(ValueError, match="stop tokens"):
        generate(target, drafter, [5, 9], cfg)
    with pytest.raises(ValueError, match="grammar rejected"):
        Constraint.from_lark(constraint.tokenizer, 'start: "[" /[a-e/')


@pytest.fixture(scope="module")
def demo():
    target, drafter = load_target(DEMO / "target"), load_drafter(DEMO / "draft")
    tokenizer = load_tokenizer(DEMO / "target")
    stops = list(tokenizer.eos_token_ids)
    text = (DEMO / "target" / "tokenizer.json").read_text()
    grammar_tokenizer = tokenizer_from_json(text, target.lm_head.weight.shape[0], stops)
    return target, drafter, tokenizer, grammar_tokenizer


def test_the_demo_pair_returns_schema_valid_json_for_every_method(demo):
    target, drafter, tokenizer, grammar_tokenizer = demo
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 24},
            "population": {"type": "integer", "minimum": 0, "maximum": 10**9},
            "capital": {"type": "boolean"},
        },
        "required": ["city", "population", "capital"],
        "additionalProperties": False,
    }
    constraint = Constraint.from_json_schema(grammar_tokenizer, schema)
    messages = [{"role": "user", "content": "Describe Paris as JSON."}]
    prompt = tokenizer.apply_chat_template(messages, enable_thinking=False)
    outputs = {}
    for method, budget in METHODS:
        cfg = GenerationConfig(
            method,
            budget,
            max_new_tokens=96,
            constraint=constraint,
            stop_token_ids=tuple(tokenizer.eos_token_ids),
        )
        result = generate(target, None if method == "ar" else drafter, prompt, cfg)
        assert result.finish_reason == "stop", tokenizer.decode(result.output_ids)
        outputs[method] = result.output_ids
        jsonschema.validate(json.loads(tokenizer.decode(result.output_ids[:-1])), schema)
    assert len(set(map(tuple, outputs.values()))) == 1, outputs
