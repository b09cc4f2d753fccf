"""Our dense Qwen3 against transformers' Qwen3ForCausalLM (float32) and against itself (float64).

Run: python -m pytest -q tests/engine/test_qwen3.py
"""

from __future__ import annotations

import pytest
import torch

from engine.models import common, load_target
from engine.models.qwen3 import Qwen3Model
from tests.helpers.tiny_qwen3 import save_tiny_qwen3

torch.set_num_threads(1)  # tiny matrices: threads only add contention on shared CPUs

TREE_PARENTS = [-1, 0, 0, 1, 1, 2, -1, 6]  # two roots, branching at 0 and 1


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def model_dir(request, tmp_path_factory):
    return save_tiny_qwen3(
        tmp_path_factory.mktemp("qwen3"), seed=3, tie_word_embeddings=request.param
    )


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import Qwen3ForCausalLM

    return Qwen3ForCausalLM.from_pretrained(model_dir).eval()


def hf_logits(hf_model, ids: list[int]) -> torch.Tensor:  # [T, V]
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0]


def path_to(parents: list[int], node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def test_prefill_logits_and_hidden_states_match_transformers(model_dir, hf_model):
    model = load_target(model_dir)
    ids = torch.randint(
        0, model.config.vocab_size, (11,), generator=torch.Generator().manual_seed(0)
    )
    logits, hidden = model.forward(ids, model.new_cache(16), hidden_layers=(0, 2))
    with torch.no_grad():
        expected = hf_model(ids[None], output_hidden_states=True)
    H = model.config.hidden_size
    assert (logits - expected.logits[0]).abs().max() <= 1e-4
    assert (hidden[:, :H] - expected.hidden_states[1][0]).abs().max() <= 1e-4
    assert (hidden[:, H:] - expected.hidden_states[3][0]).abs().max() <= 1e-4  # last layer: normed


def test_cached_decode_steps_match_transformers(model_dir, hf_model):
    model = load_target(model_dir)
    ids = list(range(5, 17))
    cache = model.new_cache(len(ids))
    model.forward(torch.tensor(ids[:6]), cache)
    model.commit(cache, torch.arange(6))
    expected = hf_logits(hf_model, ids)
    for position in range(6, len(ids)):
        logits, _ = model.forward(torch.tensor([ids[position]]), cache)
        model.commit(cache, torch.tensor([0]))
        assert (logits[0] - expected[position]).abs().max() <= 1e-4
    assert cache.length == len(ids)


def test_tree_verify_matches_each_root_to_node_path_alone(model_dir, hf_model):
    model = load_target(model_dir)
    prefix, tree_ids = [7, 3, 9, 4, 1], [11, 12, 13, 14, 15, 16, 17, 18]
    cache = model.new_cache(16)
    model.forward(torch.tensor(prefix), cache)
    model.commit(cache, torch.arange(len(prefix)))
    logits, _ = model.forward(torch.tensor(tree_ids), cache, torch.tensor(TREE_PARENTS))
    for node in range(len(tree_ids)):
        alone = prefix + [tree_ids[i] for i in path_to(TREE_PARENTS, node)]
        assert (logits[node] - hf_logits(hf_model, alone)[-1]).abs().max() <= 1e-4, node


def test_float64_prefill_decode_and_tree_agree_within_1e_10(model_dir):
    model = load_target(model_dir, dtype=torch.float64)
    prefix, tree_ids = [7, 3, 9, 4, 1], [11, 12, 13, 14, 15, 16, 17, 18]
    full_cache = model.new_cache(16)
    full, _ = model.forward(torch.tensor(prefix + tree_ids[:1] + tree_ids[2:3]), full_cache)

    cache = model.new_cache(16)
    model.forward(torch.tensor(prefix[:2]), cache)
    model.commit(cache, torch.arange(2))
    for token in prefix[2:]:
        step, _ = model.forward(torch.tensor([token]), cache)
        model.commit(cache, torch.tensor([0]))
    assert (step[0] - full[len(prefix) - 1]).abs().max() <= 1e-10
    tree, _ = model.forward(torch.tensor(tree_ids), cache, torch.tensor(TREE_PARENTS))
    assert (tree[0] - full[len(prefix)]).abs().max() <= 1e-10
    assert (tree[2] - full[len(prefix) + 1]).abs().max() <= 1e-10  # node 2's path is [0, 2]


def test_commit_keeps_only_the_accepted_path(model_dir):
    model = load_target(model_dir, dtype=torch.float64)
    prefix, tree_ids = [7, 3, 9, 4, 1], [11, 12, 13, 14, 15, 16, 17, 18]
    cache = model.new_cache(16)
    model.forward(torch.tensor(prefix), cache)
    model.commit(cache, torch.arange(len(prefix)))
    model.forward(torch.tensor(tree_ids), cache, torch.tensor(TREE_PARENTS))
    model.commit(cache, torch.tensor([0, 2, 5]))  # root 0 -> 2 -> 5
    after_commit, _ = model.forward(torch.tensor([42]), cache)

    fresh = model.new_cache(16)
    straight, _ = model.forward(torch.tensor(prefix + [11, 13, 16, 42]), fresh)
    assert cache.length == len(prefix) + 3
    assert (after_commit[0] - straight[-1]).abs().max() <= 1e-10


def test_sharded_checkpoint_loads_like_a_single_file(tmp_path):
    single = load_target(save_tiny_qwen3(tmp_path / "one", seed=4, tokenizer=False))
    sharded_dir = save_tiny_qwen3(tmp_path / "many", seed=4, max_shard_size="30KB", tokenizer=False)
    assert (sharded_dir / "model.safetensors.index.json").exists()
    sharded = load_target(sharded_dir)
    ids = torch.tensor([1, 2, 3])
    a, _ = single.forward(ids, single.new_cache(3))
    b, _ = sharded.forward(ids, sharded.new_cache(3))
    assert torch.equal(a, b)


def test_forward_refuses_to_write_past_the_cache(model_dir):
    model = load_target(model_dir)
    cache = model.new_cache(4)
    model.forward(torch.tensor([1, 2, 3]), cache)
    model.commit(cache, torch.arange(3))
    with pytest.raises(ValueError, match="KV cache full"):
        model.forward(torch.tensor([4, 5]), cache)
    assert cache.length == 3


def test_load_target_rejects_an_unknown_model_type(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ValueError, match="llama"):
        load_target(tmp_path)


def test_unsupported_qwen3_variants_are_refused(tmp_path):
    model_dir = save_tiny_qwen3(tmp_path, seed=6, tokenizer=False, attention_bias=True)
    with pytest.raises(ValueError, match="attention_bias"):
        load_target(model_dir)


def test_tied_model_shares_embedding_and_lm_head(tmp_path):
    model = load_target(
        save_tiny_qwen3(tmp_path, seed=5, tie_word_embeddings=True, tokenizer=False)
    )
    assert isinstance(model, Qwen3Model)
    assert model.lm_head.weight is model.embed_tokens.weight


def _layouts_timed(monkeypatch, input_major_share: float) -> list[list[tuple]]:
    """Loading times every weight's layouts as given (an input-major product at
    `input_major_share` of a row-major one's time) with a fresh record of the shapes decided;
    returns each sweep's shapes."""
    sweeps = []

    def seconds(weights):
        sweeps.append([tuple(weight.shape) for weight in weights])
        return [1.0 if weight.is_contiguous() else input_major_share for weight in weights]

    monkeypatch.setattr(common, "_layouts", {})
    monkeypatch.setattr(common, "sweep_seconds", seconds)
    monkeypatch.setattr(common, "LAYOUT_TIMED_FROM", 1)
    return sweeps


def test_small_weights_are_input_major_untimed(tmp_path, monkeypatch):
    sweeps = _layouts_timed(monkeypatch, input_major_share=2.0)
    monkeypatch.setattr(common, "LAYOUT_TIMED_FROM", 64 * 32 + 1)  # lm_head [96, 32] timed
    model_dir = save_tiny_qwen3(tmp_path, seed=6, tokenizer=False)
    model = load_target(model_dir)
    up = model.layers[0].mlp.up_proj.weight  # [64, 32]
    assert up.stride() == (1, up.shape[0])
    assert model.lm_head.weight.is_contiguous()  # timed: row-major was faster
    assert sweeps == [[tuple(model.lm_head.weight.shape)]] * 2


def test_cpu_loading_lays_linear_weights_out_input_major_where_faster_values_and_ties_kept(
    tmp_path, monkeypatch
):
    from safetensors.torch import load_file

    sweeps = _layouts_timed(monkeypatch, input_major_share=0.5)
    model_dir = save_tiny_qwen3(tmp_path, seed=6, tie_word_embeddings=True, tokenizer=False)
    saved = load_file(model_dir / "model.safetensors")
    model = load_target(model_dir)
    up = model.layers[0].mlp.up_proj.weight
    assert up.stride() == (1, up.shape[0])  # [out, in] viewed over a contiguous [in, out]
    assert torch.equal(up, saved["model.layers.0.mlp.up_proj.weight"])
    assert model.lm_head.weight is model.embed_tokens.weight  # still one tied parameter
    assert model.lm_head.weight.stride() == (1, model.lm_head.weight.shape[0])
    assert torch.equal(model.embed_tokens.weight, saved["model.embed_tokens.weight"])
    assert len(sweeps) == 2  # each layout's sweep over the model's weights, each weight once
    assert len(sweeps[0]) == len(set(map(id, common._linear_weights(model))))
    again = load_target(model_dir).layers[0].mlp.up_proj.weight
    assert again.stride() == up.stride()  # a second load lays the decided shapes out alike,
    assert len(sweeps) == 2  # untimed
    # bfloat16 gains nothing from the layout (measured), so it keeps the row-major one
    bf16 = load_target(model_dir, dtype=torch.bfloat16)
    assert bf16.layers[0].mlp.up_proj.weight.is_contiguous()


def test_cpu_loading_keeps_row_major_weights_where_input_major_is_not_clearly_faster(
    tmp_path, monkeypatch
):
    _layouts_timed(monkeypatch, input_major_share=(1 + common.LAYOUT_GAIN) / 2)
    model_dir = save_tiny_qwen3(tmp_path, seed=6, tie_word_embeddings=True, tokenizer=False)
    model = load_target(model_dir)
    assert model.layers[0].mlp.up_proj.weight.is_contiguous()
    assert model.lm_head.weight.is_contiguous()
    assert model.lm_head.weight is model.embed_tokens.weight


def test_a_sweep_times_every_weight():
    seconds = common.sweep_seconds([torch.randn(64, 32), torch.randn(8, 64)])
    assert len(seconds) == 2 and all(0 < s < 1 for s in seconds)
