"""The demo-model training pipeline: corpus split, prompts, DFlash batches, a mini run end to end.

    python -m pytest -q tests/engine/tools/test_train_demo.py

The mini run (engine.tools.train_demo.MINI: tiny sizes and steps) trains once per module; its
directories must load in transformers and in our engine, and decode there like in transformers.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine.__main__ import main
from engine.data import corpus
from engine.tools import train_demo as td
from tests.helpers.tiny_hybrid import torch_threads

DEMO_MODEL = td.DEMO_MODEL


@pytest.fixture(scope="module")
def mini(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, list[str]]:
    out = tmp_path_factory.mktemp("demo")
    logs: list[str] = []
    with torch_threads(1):
        report = td.train_demo(out, td.MINI, log=logs.append)
    return out, report, logs


@pytest.fixture(scope="module")
def mini_dense(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dense")
    with torch_threads(1):
        td.train_demo(out, replace(td.MINI, dense=True), log=lambda _: None)
    return out


def test_held_out_split_is_disjoint_deterministic_and_every_tenth_file():
    train, held_out = corpus.stdlib_files()
    assert corpus.stdlib_files() == (train, held_out)
    assert not set(train) & set(held_out)
    everything = sorted(train + held_out)
    assert held_out == everything[:: corpus.HELD_OUT_EVERY]
    assert all(f.suffix == ".py" for f in everything)


def test_held_out_prompts_end_with_a_def_line_of_a_held_out_file():
    prompts = corpus.held_out_prompts(4)
    held_out_texts = corpus.read_texts(corpus.stdlib_files()[1])
    assert len(prompts) == 4
    for prompt in prompts:
        assert prompt.splitlines()[-1].lstrip().startswith("def ")
        assert prompt.endswith(":\n")
        assert any(prompt in text for text in held_out_texts)


def test_layer_ids_spread_from_first_to_last():
    assert td.spread_layer_ids(4, 3) == [0, 2, 3]
    assert td.spread_layer_ids(6, 4) == [0, 2, 3, 5]
    assert td.spread_layer_ids(4, 1) == [3]


def test_blocks_are_bonus_then_masks_and_labels_are_the_next_tokens():
    sequences = torch.arange(100, 120).view(2, 10)
    data = td.DraftData(sequences, torch.zeros(2, 10, 4, dtype=torch.half), first_anchor=3)
    blocks, labels = td.block_inputs(data, torch.tensor([1]), torch.tensor([[3, 6]]), 4, mask_id=7)
    assert blocks.tolist() == [[[113, 7, 7, 7], [116, 7, 7, 7]]]
    assert labels.tolist() == [[[114, 115, 116], [117, 118, 119]]]
    rows, starts = td.sample_blocks(data, 50, 3, 4, torch.Generator().manual_seed(0))
    assert rows.shape == (50,) and starts.shape == (50, 3)
    assert starts.min() >= 3 and starts.max() <= 10 - 4


def test_position_weights_decay_and_sum_to_one():
    weights = td.position_weights(16, decay=7.0)
    assert weights.shape == (15,)
    assert weights.sum().item() == pytest.approx(1.0)
    assert weights[0] / weights[7] == pytest.approx(math.e)


def test_accepted_prefix_stops_at_the_first_miss():
    labels = torch.tensor([[1, 2, 3], [1, 2, 3], [0, 2, 3]])
    logits = torch.nn.functional.one_hot(torch.tensor([1, 2, 0]).expand(3, 3), 4).float()
    assert td.accepted_prefix(logits, labels).tolist() == [2, 2, 0]


def test_chain_tau_walks_rounds_like_decoding_does():
    # row 1: a round at 0 commits 3 drafts + bonus, then rounds at 4 (1 token) and 5 (2 tokens)
    accepted = torch.tensor([[3, 9, 9, 9, 0, 1, 9], [0, 0, 0, 0, 0, 0, 0]])
    assert td.chain_tau(accepted) == pytest.approx((7 + 7) / (3 + 7))
    assert td.chain_tau(torch.zeros(1, 5, dtype=torch.long)) == 1.0


def test_accepted_everywhere_is_what_a_linear_decode_accepts(mini):
    from engine.decode import GenerationConfig, generate
    from engine.models import load_drafter, load_target

    out, _, _ = mini
    hf, tokenizer = td.load_target_for_training(out / "target")
    target, drafter = load_target(out / "target"), load_drafter(out / "draft")
    prompt = tokenizer.encode(corpus.held_out_prompts(1)[0]).ids[-12:]
    with torch.no_grad():
        result = generate(target, drafter, prompt, GenerationConfig("linear", max_new_tokens=40))
    sequence = torch.tensor([prompt + result.output_ids])
    features = td.context_features(hf, sequence, list(drafter.target_layer_ids))
    accepted = td.accepted_everywhere(
        drafter, hf, td.DraftData(sequence, features, first_anchor=len(prompt))
    )[0].tolist()
    position, compared = 0, 0
    for committed in result.acceptance_lengths:
        if position + drafter.block_size >= len(result.output_ids):  # max_new_tokens cuts it
            break
        assert committed == accepted[position] + 1, f"round at {position}"
        position, compared = position + committed, compared + 1
    assert compared >= 8


def test_mini_run_trains_both_models_and_reports(mini):
    out, report, logs = mini
    vocab = td.MINI.vocab_size
    assert report["target_final_loss"] < math.log(vocab) - 0.3  # better than uniform
    assert report["drafter_final_loss"] < math.log(vocab)
    assert 0.0 < report["held_out_next_token_accuracy"] < 1.0
    assert 1.0 <= report["held_out_linear_tau"] <= td.MINI.block_size
    assert json.loads((out / "training.json").read_text()) == report
    assert any(line.startswith("drafter step") for line in logs)


def test_mini_dirs_load_in_transformers_and_in_our_engine_alike(mini):
    from transformers import Qwen3_5ForCausalLM

    from engine.models import load_drafter, load_target

    out, _, _ = mini
    ids = torch.tensor([5, 17, 3, 9, 44, 2])
    hf = Qwen3_5ForCausalLM.from_pretrained(out / "target", dtype=torch.float32).eval()
    ours = load_target(out / "target")
    with torch.no_grad():
        expected = hf(input_ids=ids[None]).logits[0]  # [T, V]
        logits, _ = ours.forward(ids, ours.new_cache(16))
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    drafter = load_drafter(out / "draft")
    assert drafter.block_size == td.MINI.block_size
    assert list(drafter.target_layer_ids) == td.spread_layer_ids(td.MINI.num_layers, 3)


def test_drafter_features_are_the_engine_targets_layer_outputs(mini):
    from engine.models import load_target

    out, _, _ = mini
    hf, _ = td.load_target_for_training(out / "target")
    ours = load_target(out / "target")
    ids = torch.tensor([5, 17, 3, 9, 44, 2])
    layers = list(range(td.MINI.num_layers))  # the last one too: raw output, no final norm
    features = td.context_features(hf, ids[None], layers)[0].float()  # fp16-rounded
    _, hidden = ours.forward(ids, ours.new_cache(16), hidden_layers=layers)
    torch.testing.assert_close(features, hidden, atol=2e-3, rtol=2e-3)


def test_warm_started_drafter_reads_the_context_as_the_targets_last_attention_layer(mini):
    from engine.models.dflash import DFlashConfig, DFlashDrafter

    out, _, _ = mini
    hf, tokenizer = td.load_target_for_training(out / "target")
    config = td.drafter_config(td.MINI, hf.config, tokenizer.token_to_id(td.MASK_TOKEN))
    layer_ids = config["dflash_config"]["target_layer_ids"]
    drafter = DFlashDrafter(DFlashConfig.from_dict(config))
    td.warm_start(drafter, hf)
    ids = torch.tensor([[5, 17, 3, 9, 44, 2]])
    captured = {}
    hooks = [
        hf.model.layers[i].register_forward_hook(
            lambda _m, _i, output, i=i: captured.__setitem__(i, output)
        )
        for i in range(td.MINI.num_layers)
    ]
    with torch.no_grad():
        last_hidden = hf.model(input_ids=ids).last_hidden_state
        for hook in hooks:
            hook.remove()
        features = torch.cat([captured[i] for i in layer_ids], dim=-1)
        source = hf.model.layers[-1]  # the last layer is a full-attention one in MINI
        fed = source.input_layernorm(captured[td.MINI.num_layers - 2])
        context = drafter.hidden_norm(drafter.fc(features))
        query_and_gate = source.self_attn.q_proj(fed).unflatten(
            -1, (drafter.config.num_attention_heads, -1)
        )
        query = query_and_gate[..., : drafter.config.head_dim].flatten(-2)  # each head: query, gate
        x = captured[td.MINI.num_layers - 1]
        assert len(drafter.layers) == td.MINI.drafter_layers
        for layer in drafter.layers:
            attention = layer.self_attn
            torch.testing.assert_close(attention.v_proj(context), source.self_attn.v_proj(fed))
            torch.testing.assert_close(attention.q_proj(fed), query)
            torch.testing.assert_close(
                layer.mlp(layer.post_attention_layernorm(x)),
                source.mlp(source.post_attention_layernorm(x)),
            )
        torch.testing.assert_close(drafter.norm(x), last_hidden)


def test_dense_mini_target_is_qwen3_and_decodes_in_our_engine_as_in_transformers(mini_dense):
    from transformers import Qwen3ForCausalLM

    from engine.decode import GenerationConfig, generate
    from engine.models import load_drafter, load_target

    config = json.loads((mini_dense / "target" / "config.json").read_text())
    assert config["model_type"] == "qwen3"
    assert set(config.get("layer_types", ["full_attention"])) == {"full_attention"}
    ids = torch.tensor([5, 17, 3, 9, 44, 2])
    hf = Qwen3ForCausalLM.from_pretrained(mini_dense / "target", dtype=torch.float32).eval()
    ours, drafter = load_target(mini_dense / "target"), load_drafter(mini_dense / "draft")
    with torch.no_grad():
        expected = hf(input_ids=ids[None]).logits[0]
        logits, _ = ours.forward(ids, ours.new_cache(16))
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
        plain = generate(ours, None, ids.tolist(), GenerationConfig("ar", max_new_tokens=24))
        tree = generate(ours, drafter, ids.tolist(), GenerationConfig("ddtree", max_new_tokens=24))
    assert tree.output_ids == plain.output_ids
    # the DDTree reference reads transformers' hidden states, whose last one is normed
    assert list(drafter.target_layer_ids) == td.spread_layer_ids(td.MINI.num_layers - 1, 3)


def test_warm_started_drafter_copies_a_dense_targets_last_layer_as_it_is(mini_dense):
    from engine.models.dflash import DFlashConfig, DFlashDrafter

    hf, tokenizer = td.load_target_for_training(mini_dense / "target")
    recipe = replace(td.MINI, dense=True)
    config = td.drafter_config(recipe, hf.config, tokenizer.token_to_id(td.MASK_TOKEN))
    drafter = DFlashDrafter(DFlashConfig.from_dict(config))
    td.warm_start(drafter, hf)
    source = hf.model.layers[-1]
    x = torch.randn(3, td.MINI.hidden_size)
    with torch.no_grad():
        for layer in drafter.layers:  # plain RMSNorms (no 1 + w) and an ungated q_proj
            torch.testing.assert_close(layer.input_layernorm(x), source.input_layernorm(x))
            torch.testing.assert_close(layer.self_attn.q_proj(x), source.self_attn.q_proj(x))
            torch.testing.assert_close(layer.mlp(x), source.mlp(x))
        torch.testing.assert_close(drafter.norm(x), hf.model.norm(x))


def test_mini_dirs_are_fp16_with_a_tokenizer_whose_mask_token_the_drafter_uses(mini):
    from engine.tokenizer import load_tokenizer

    out, _, _ = mini
    for part in ("target", "draft"):
        weights = load_file(out / part / "model.safetensors")
        assert {tensor.dtype for tensor in weights.values()} == {torch.float16}
    tokenizer = load_tokenizer(out / "target")
    code = "def f(x):\n    return x + 1\n"
    assert tokenizer.decode(tokenizer.encode(code)) == code
    assert tokenizer.encode(td.EOS_TOKEN) == list(tokenizer.eos_token_ids)
    chat = tokenizer.decode(
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]), False
    )
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    draft_config = json.loads((out / "draft" / "config.json").read_text())
    mask_id = draft_config["dflash_config"]["mask_token_id"]
    assert tokenizer.decode([mask_id], False) == td.MASK_TOKEN


def test_reuse_target_needs_a_trained_target(tmp_path, capsys):
    assert main(["train-demo", "--out", str(tmp_path), "--reuse-target", "--mini"]) == 2
    assert "holds no trained target" in capsys.readouterr().err


def test_reuse_target_refuses_the_other_kind_of_target(mini, mini_dense, capsys):
    hybrid = ["train-demo", "--out", str(mini[0]), "--reuse-target", "--mini", "--dense"]
    assert main(hybrid) == 2
    assert "holds a hybrid target (qwen3_5_text): drop --dense" in capsys.readouterr().err
    assert main(["train-demo", "--out", str(mini_dense), "--reuse-target", "--mini"]) == 2
    assert "holds a dense target (qwen3): add --dense" in capsys.readouterr().err


def test_shipped_demo_pair_is_small_and_complete():
    files = [p for p in DEMO_MODEL.rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) <= 20 * 2**20
    for part in ("target", "draft"):
        assert (DEMO_MODEL / part / "config.json").exists()
        assert (DEMO_MODEL / part / "model.safetensors").exists()
    assert (DEMO_MODEL / "target" / "tokenizer.json").exists()
    report = json.loads((DEMO_MODEL / "training.json").read_text())
    assert report["recipe"] == json.loads(json.dumps(td.asdict(td.Recipe())))


def test_reusing_the_saved_target_trains_the_same_drafter(mini, tmp_path):
    """The saved target is exactly the one a full run drafts from (RoPE buffers included)."""
    out, report, _ = mini
    shutil.copytree(out / "target", tmp_path / "target")
    with torch_threads(1):
        again = td.train_demo(tmp_path, td.MINI, log=lambda _: None, reuse_target=True)
    first = load_file(out / "draft" / "model.safetensors")
    second = load_file(tmp_path / "draft" / "model.safetensors")
    assert first.keys() == second.keys()
    assert all(torch.equal(first[name], second[name]) for name in first)
    assert again["drafter_final_loss"] == report["drafter_final_loss"]
