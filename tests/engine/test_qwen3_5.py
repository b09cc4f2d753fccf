"""The hybrid target (engine/models/qwen3_5.py) against transformers' Qwen3_5ForCausalLM, on CPU.

    python -m pytest -q tests/engine/test_qwen3_5.py

Float32 with default init: prefill, cached decode steps and tree verify (each node's logits equal
those of its root-to-node path run alone) match transformers within 2e-4. transformers runs the
gated delta rule in float32 whatever the model dtype, so in float64 our own prefill, cached decode
and tree verify are checked against each other (1e-10). All three state strategies commit the same
state; `pending_bytes` is the memory the pending round really holds.
"""

from __future__ import annotations

import pytest
import torch

from engine.models import gated_deltanet
from engine.models.common import Segment
from engine.models.gated_deltanet import pending_bytes
from engine.models.qwen3_5 import Qwen3_5Model, load_qwen3_5
from tests.helpers.tiny_hybrid import build_tiny_hybrid, save_tiny_hybrid

TOL_VS_TRANSFORMERS = 2e-4
TOL_FLOAT64 = 1e-10
VOCAB = 128


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    return save_tiny_hybrid(tmp_path_factory.mktemp("hybrid"), seed=0)


@pytest.fixture(scope="module")
def reference():
    """The transformers model saved in `hybrid_dir` (same seed)."""
    return build_tiny_hybrid(seed=0)


def hf_logits(reference, ids: list[int]) -> torch.Tensor:  # [len(ids), V]
    with torch.no_grad():
        return reference(torch.tensor([ids])).logits[0]


def random_tree(size: int, generator: torch.Generator) -> torch.Tensor:
    """parents [size]: node 0 is the root (-1), every other node hangs under an earlier one."""
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=generator)) for i in range(1, size)]
    return torch.tensor(parents)


def path_to(parents: torch.Tensor, node: int) -> list[int]:
    """Indices from the root to `node`, root first."""
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(int(parents[path[-1]]))
    return path[::-1]


def prefill(model: Qwen3_5Model, prompt: list[int], max_len: int = 64):
    cache = model.new_cache(max_len)
    logits, _ = model.forward(torch.tensor(prompt), cache)
    model.commit(cache, torch.arange(len(prompt)))
    return cache, logits


def decode_steps(model: Qwen3_5Model, cache, tokens: list[int]) -> torch.Tensor:
    """Each token as one AR step (forward + commit([0])); logits [len(tokens), V]."""
    rows = []
    for token in tokens:
        logits, _ = model.forward(torch.tensor([token]), cache)
        model.commit(cache, torch.tensor([0]))
        rows.append(logits[0])
    return torch.stack(rows)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


@pytest.mark.parametrize("tied", [False, True])
def test_prefill_logits_and_hidden_layers_match_transformers(tmp_path, tied):
    path = save_tiny_hybrid(tmp_path / "m", seed=3, tie_word_embeddings=tied, tokenizer=False)
    reference = build_tiny_hybrid(seed=3, tie_word_embeddings=tied)
    model = load_qwen3_5(path)
    assert (model.lm_head.weight is model.embed_tokens.weight) == tied
    ids = torch.randint(0, VOCAB, (13,), generator=torch.Generator().manual_seed(0))
    logits, hidden = model.forward(ids, model.new_cache(32), hidden_layers=[0, 1, 2])
    with torch.no_grad():
        out = reference(ids[None], output_hidden_states=True)
    assert logits.dtype == torch.float32 and logits.shape == (13, VOCAB)
    assert max_diff(logits, out.logits[0]) <= TOL_VS_TRANSFORMERS
    assert hidden.shape == (13, 3 * 32)
    for n, layer in enumerate([0, 1, 2]):
        assert max_diff(hidden[:, n * 32 : (n + 1) * 32], out.hidden_states[layer + 1][0]) <= 1e-5


def test_multimodal_checkpoint_loads_its_text_part(tmp_path, hybrid_dir, reference):
    path = save_tiny_hybrid(tmp_path / "mm", seed=0, multimodal=True, tokenizer=False)
    model = load_qwen3_5(path)
    ids = [5, 9, 17, 3]
    logits, _ = model.forward(torch.tensor(ids), model.new_cache(8))
    assert max_diff(logits, hf_logits(reference, ids)) <= TOL_VS_TRANSFORMERS


def test_cached_decode_matches_transformers(hybrid_dir, reference):
    model = load_qwen3_5(hybrid_dir)
    prompt, continuation = [7, 3, 99, 42, 1, 64, 8], [11, 120, 5, 5, 77, 30, 2, 9, 61]
    cache, prompt_logits = prefill(model, prompt)
    step_logits = decode_steps(model, cache, continuation)
    expected = hf_logits(reference, prompt + continuation)
    assert cache.length == len(prompt) + len(continuation)
    assert max_diff(prompt_logits, expected[: len(prompt)]) <= TOL_VS_TRANSFORMERS
    assert max_diff(step_logits, expected[len(prompt) :]) <= TOL_VS_TRANSFORMERS


@pytest.mark.parametrize("strategy", ["replay", "snapshot", "factored"])
def test_tree_verify_matches_each_path_run_alone(hybrid_dir, reference, strategy):
    model = load_qwen3_5(hybrid_dir, state_strategy=strategy)
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, VOCAB, (9,), generator=generator).tolist()
    cache, _ = prefill(model, prompt)
    parents = random_tree(12, generator)
    tokens = torch.randint(0, VOCAB, (12,), generator=generator)
    logits, _ = model.forward(tokens, cache, parents)
    assert cache.length == len(prompt)  # a verify pass commits nothing
    leaves = sorted(set(range(12)) - set(parents.tolist()))
    checked = set()
    for leaf in leaves:  # one run per leaf checks every node on its path
        path = path_to(parents, leaf)
        alone = hf_logits(reference, prompt + tokens[path].tolist())[len(prompt) :]
        assert max_diff(logits[path], alone) <= TOL_VS_TRANSFORMERS, path
        checked.update(path)
    assert checked == set(range(12))
    # Commit the path to the deepest node, then one more step continues from exactly that path.
    deepest = max(range(12), key=lambda n: len(path_to(parents, n)))
    accepted = path_to(parents, deepest)
    model.commit(cache, torch.tensor(accepted))
    assert cache.length == len(prompt) + len(accepted)
    next_logits = decode_steps(model, cache, [17])
    expected = hf_logits(reference, prompt + tokens[accepted].tolist() + [17])[-1]
    assert max_diff(next_logits[0], expected) <= TOL_VS_TRANSFORMERS


def test_committing_part_of_a_chain_keeps_only_that_part(hybrid_dir, reference):
    """The DFlash `linear` case: verify a chain, accept a prefix of it."""
    model = load_qwen3_5(hybrid_dir)
    prompt, chain = [4, 8, 15, 16], [23, 42, 108, 7, 77]
    cache, _ = prefill(model, prompt)
    model.forward(torch.tensor(chain), cache)
    model.commit(cache, torch.arange(2))
    next_logits = decode_steps(model, cache, [60])
    expected = hf_logits(reference, prompt + chain[:2] + [60])[-1]
    assert max_diff(next_logits[0], expected) <= TOL_VS_TRANSFORMERS


@pytest.mark.parametrize("strategy", ["replay", "snapshot", "factored"])
def test_float64_prefill_decode_and_tree_agree(hybrid_dir, strategy):
    model = load_qwen3_5(hybrid_dir, dtype=torch.float64, state_strategy=strategy)
    generator = torch.Generator().manual_seed(2)
    ids = torch.randint(0, VOCAB, (14,), generator=generator).tolist()
    _, all_at_once = prefill(model, ids)
    cache, first = prefill(model, ids[:5])
    one_by_one = torch.cat([first, decode_steps(model, cache, ids[5:])])
    assert all_at_once.dtype == torch.float64
    assert max_diff(all_at_once, one_by_one) <= TOL_FLOAT64
    # The same continuation as one branch of a tree with decoys hanging off it.
    cache, _ = prefill(model, ids[:5])
    branch = ids[5:]
    decoys = torch.randint(0, VOCAB, (len(branch),), generator=generator).tolist()
    tokens = [t for pair in zip(branch, decoys, strict=True) for t in pair]  # branch, decoy, ...
    parents = [-1 if i == 0 else (i - 2 if i % 2 == 0 else i - 1) for i in range(len(tokens))]
    logits, _ = model.forward(torch.tensor(tokens), cache, torch.tensor(parents))
    assert max_diff(logits[0::2], all_at_once[5:]) <= TOL_FLOAT64
    model.commit(cache, torch.arange(0, len(tokens), 2))
    final = decode_steps(model, cache, [3])
    _, reference_run = prefill(model, ids + [3])
    assert max_diff(final[0], reference_run[-1]) <= TOL_FLOAT64


def test_strategies_commit_identical_state_and_pending_bytes_is_exact(hybrid_dir, monkeypatch):
    # Replay re-runs the 6-token prefill in two pieces.
    monkeypatch.setattr(gated_deltanet, "REPLAY_PIECE", 4)
    generator = torch.Generator().manual_seed(4)
    prompt = torch.randint(0, VOCAB, (6,), generator=generator)
    parents = random_tree(10, generator)
    tokens = torch.randint(0, VOCAB, (10,), generator=generator)
    accepted = torch.tensor(path_to(parents, 9))
    states = {}
    for strategy in ("replay", "snapshot", "factored"):
        model = load_qwen3_5(hybrid_dir, dtype=torch.float64, state_strategy=strategy)
        cache, _ = prefill(model, prompt.tolist())
        model.forward(tokens, cache, parents)
        held = sum(p.nbytes() for p in cache.pending)
        shape = model.config.gdn_shape()
        assert held == pending_bytes(shape, len(cache.recurrent), 10, strategy, torch.float64)
        model.commit(cache, accepted)
        states[strategy] = cache.recurrent
    for replayed, snapshot, factored in zip(*states.values(), strict=True):
        assert torch.equal(replayed.conv, snapshot.conv)
        assert torch.equal(replayed.conv, factored.conv)
        assert max_diff(replayed.recurrent, snapshot.recurrent) <= 1e-12
        assert max_diff(replayed.recurrent, factored.recurrent) <= 1e-12


def test_bfloat16_model_keeps_float32_state_and_stays_close(hybrid_dir):
    prompt, tree = list(range(20)), torch.tensor([-1, 0, 0, 1, 1, 2, 3, 3])
    runs = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = load_qwen3_5(hybrid_dir, dtype=dtype)
        cache, prompt_logits = prefill(model, prompt)
        tree_logits, _ = model.forward(torch.arange(8), cache, tree)
        model.commit(cache, torch.tensor([0, 1, 4]))
        runs[dtype] = torch.cat([prompt_logits, tree_logits, decode_steps(model, cache, [3])])
        assert cache.recurrent[0].recurrent.dtype == torch.float32
        assert cache.recurrent[0].conv.dtype == dtype
    assert runs[torch.bfloat16].dtype == torch.float32
    assert max_diff(runs[torch.bfloat16], runs[torch.float32]) < 0.02


def test_config_without_layer_types_uses_full_attention_interval():
    from engine.models.qwen3_5 import Qwen3_5Config

    hf = {**{k: v for k, v in build_tiny_hybrid().config.to_dict().items()}, "num_hidden_layers": 8}
    del hf["layer_types"]
    hf["full_attention_interval"] = 4
    config = Qwen3_5Config.from_hf(hf)
    assert config.layer_types == ("linear_attention",) * 3 + ("full_attention",) + (
        "linear_attention",
    ) * 3 + ("full_attention",)
    assert config.partial_rotary_factor == 0.25


def test_forward_past_max_len_and_bad_commits_raise(hybrid_dir):
    model = load_qwen3_5(hybrid_dir)
    cache, _ = prefill(model, [1, 2, 3], max_len=5)
    with pytest.raises(ValueError, match="max_len"):
        model.forward(torch.tensor([4, 5, 6]), cache)
    with pytest.raises(ValueError, match="commit without a forward"):
        model.commit(cache, torch.tensor([0]))
    model.forward(torch.tensor([4, 5]), cache, torch.tensor([-1, -1]))
    with pytest.raises(ValueError, match="not a root-to-node path"):
        model.commit(cache, torch.tensor([0, 1]))  # siblings, not parent and child
    batched, _ = prefill(model, [1, 2, 3], max_len=8)  # a batched pass's trees: checked on the host
    model.forward_batch([Segment(torch.tensor([4, 5, 6]), batched, torch.tensor([-1, 0, 0]))])
    with pytest.raises(ValueError, match="not a root-to-node path"):
        model.commit_batch([(batched, [0, 1, 2])])  # 2 hangs from the root, not from 1


def test_auto_strategy_factors_on_cpu_and_sizes_snapshots_for_triton(hybrid_dir):
    from engine.models.gated_deltanet import choose_strategy, qwen36_27b_shape

    assert choose_strategy(qwen36_27b_shape(), 16, torch.float32) == "replay"  # 48 MiB a layer
    tiny = load_qwen3_5(hybrid_dir).config.gdn_shape()
    assert choose_strategy(tiny, 16, torch.float32) == "snapshot"
    assert choose_strategy(tiny, 1_000_000, torch.float32) == "replay"
    assert choose_strategy(qwen36_27b_shape(), 16, torch.float32, "batched") == "factored"
    assert choose_strategy(tiny, 200, torch.float32, "batched") == "factored"  # a short prefill
    assert choose_strategy(tiny, 100_000, torch.float32, "batched") == "replay"
    assert choose_strategy(qwen36_27b_shape(), 200, torch.float32, "batched") == "replay"
    model = load_qwen3_5(hybrid_dir)  # auto by default: on CPU a round keeps the solve's factors
    cache, _ = prefill(model, [1, 2, 3])
    model.forward(torch.arange(4), cache, torch.tensor([-1, 0, 0, 1]))
    assert all(p.tree_states is not None and p.node_states is None for p in cache.pending)


def test_serving_defaults_to_the_configs_context_limit(hybrid_dir):
    from engine.server.app import load_engine

    assert load_engine(hybrid_dir).max_model_len == 512  # tests/helpers/tiny_hybrid.py
    assert load_engine(hybrid_dir, max_model_len=100).max_model_len == 100
