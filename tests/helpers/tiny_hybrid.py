"""Tiny random hybrid targets (Qwen3.5: Gated DeltaNet + gated attention) in HF format for tests.

    from tests.helpers.tiny_hybrid import save_tiny_hybrid, save_tiny_hybrid_drafter
    target_dir = save_tiny_hybrid(tmp_path / "target", seed=0)
    draft_dir = save_tiny_hybrid_drafter(tmp_path / "draft", target_dir, seed=1)

The target is transformers' own Qwen3_5ForCausalLM (default init unless overridden) written with
save_pretrained (safetensors, `model_type: qwen3_5_text`), plus the word-level tokenizer of
tests/helpers/tiny_qwen3.py; `multimodal=True` rewrites it as a `qwen3_5` checkpoint (text
tensors under `model.language_model.`, a stand-in vision tensor). The drafter is a z-lab-layout
DFlash directory sized for the target. Everything is deterministic from the seeds.

`python -m tests.helpers.tiny_hybrid` times one 16-token tree verify round (forward + commit)
and one AR step on the tiny hybrid for both GDN state strategies (engine/models/gated_deltanet.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests.helpers.tiny_qwen3 import SPECIAL_TOKENS, save_tiny_dflash, save_tiny_tokenizer

TINY_HYBRID = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=4,
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,  # partial_rotary_factor 0.25: RoPE on 4 of 16 dims
    linear_num_key_heads=2,
    linear_num_value_heads=4,  # two value heads per key head
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    max_position_embeddings=512,
)


@contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """Run torch ops on `count` CPU threads inside the block, then restore the previous number."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def build_tiny_hybrid(seed: int = 0, **overrides):
    """The transformers Qwen3_5ForCausalLM (float32, eval) that `save_tiny_hybrid` writes."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(seed)
    settings = {**TINY_HYBRID, **overrides}
    settings.setdefault("eos_token_id", SPECIAL_TOKENS.index("<|im_end|>"))
    return Qwen3_5ForCausalLM(Qwen3_5TextConfig(**settings)).eval()


def save_tiny_hybrid(
    path: str | Path,
    seed: int = 0,
    multimodal: bool = False,
    tokenizer: bool = True,
    **overrides,
) -> Path:
    """Save a random tiny hybrid target directory; `overrides` are Qwen3_5TextConfig fields."""
    path = Path(path)
    model = build_tiny_hybrid(seed, **overrides)
    model.save_pretrained(path)
    if multimodal:
        _as_multimodal_checkpoint(path)
    if tokenizer:
        save_tiny_tokenizer(path, model.config.vocab_size)
    return path


def save_tiny_hybrid_drafter(
    path: str | Path, target_dir: str | Path, seed: int = 1, **options
) -> Path:
    """A random DFlash drafter (z-lab layout) for the `qwen3_5_text` target in `target_dir`.

    Defaults: block size 4, two layers reading the first and the second-to-last target layer;
    `options` are those of tests.helpers.tiny_qwen3.save_tiny_dflash.
    """
    config = json.loads((Path(target_dir) / "config.json").read_text())
    options.setdefault("target_layer_ids", (0, config["num_hidden_layers"] - 2))
    return save_tiny_dflash(path, target_dir, seed=seed, **options)


def _as_multimodal_checkpoint(path: Path) -> None:
    """Rewrite a saved qwen3_5_text directory in the layout of a `qwen3_5` (vision+text) one."""
    text_config = json.loads((path / "config.json").read_text())
    tensors = load_file(str(path / "model.safetensors"))
    renamed = {
        name if name.startswith("lm_head.") else "model.language_model." + name[len("model.") :]: t
        for name, t in tensors.items()
    }
    renamed["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 3, 2, 2, 2)
    renamed["mtp.fc.weight"] = torch.zeros(2, 2)  # multi-token-prediction head: not ours
    save_file(renamed, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "tie_word_embeddings": text_config.get("tie_word_embeddings", False),
        "text_config": text_config,
        "vision_config": {"model_type": "qwen3_5_vision", "depth": 1},
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))


def time_state_strategies(rounds: int = 40, prompt_len: int = 64) -> dict[str, dict[str, float]]:
    """Milliseconds per verify forward, commit and AR step for each GDN state strategy."""
    import tempfile
    import time

    from engine.models.gated_deltanet import STATE_STRATEGIES
    from engine.models.qwen3_5 import load_qwen3_5

    generator = torch.Generator().manual_seed(0)
    parents = torch.tensor(
        [-1] + [int(torch.randint(0, i, (1,), generator=generator)) for i in range(1, 16)]
    )
    tokens = torch.randint(0, TINY_HYBRID["vocab_size"], (16,), generator=generator)
    path = [15]
    while parents[path[-1]] >= 0:
        path.append(int(parents[path[-1]]))
    accepted = torch.tensor(path[::-1])
    results = {}
    with tempfile.TemporaryDirectory() as tmp, torch_threads(1):
        model_dir = save_tiny_hybrid(Path(tmp) / "hybrid", seed=0, tokenizer=False)
        for strategy in STATE_STRATEGIES:
            model = load_qwen3_5(model_dir, state_strategy=strategy)
            cache = model.new_cache(prompt_len + rounds * (len(accepted) + 1) + 16)
            model.forward(torch.arange(prompt_len), cache)
            model.commit(cache, torch.arange(prompt_len))
            totals = dict.fromkeys(("verify", "commit", "ar_step"), 0.0)
            for _ in range(rounds):
                start = time.perf_counter()
                model.forward(tokens, cache, parents)
                verified = time.perf_counter()
                model.commit(cache, accepted)
                committed = time.perf_counter()
                model.forward(tokens[:1], cache)
                model.commit(cache, torch.tensor([0]))
                stepped = time.perf_counter()
                totals["verify"] += verified - start
                totals["commit"] += committed - verified
                totals["ar_step"] += stepped - committed
            results[strategy] = {name: 1e3 * t / rounds for name, t in totals.items()}
    return results


if __name__ == "__main__":
    for strategy, ms in time_state_strategies().items():
        print(
            f"{strategy:8s} verify(16) {ms['verify']:6.2f} ms  commit(path of 6) {ms['commit']:6.2f} ms"
            f"  round {ms['verify'] + ms['commit']:6.2f} ms  AR step {ms['ar_step']:6.2f} ms"
        )
