"""Tiny random models in HF format for engine tests: a dense Qwen3 target, a z-lab-layout DFlash
drafter, and a word-level tokenizer. Every function writes into a given directory and is
deterministic from its seed.

    from tests.helpers.tiny_qwen3 import save_tiny_qwen3, save_tiny_dflash
    target_dir = save_tiny_qwen3(tmp_path / "target", seed=0)
    draft_dir = save_tiny_dflash(tmp_path / "draft", target_dir, seed=1)
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)

TINY_QWEN3 = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=512,
    rope_theta=10000.0,
)


def save_tiny_qwen3(
    path: str | Path,
    seed: int = 0,
    tie_word_embeddings: bool = False,
    max_shard_size: str | None = None,
    tokenizer: bool = True,
    **overrides,
) -> Path:
    """A random transformers Qwen3ForCausalLM (default init) saved with save_pretrained."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    path = Path(path)
    torch.manual_seed(seed)
    settings = {**TINY_QWEN3, **overrides, "tie_word_embeddings": tie_word_embeddings}
    settings["eos_token_id"] = SPECIAL_TOKENS.index("<|im_end|>")
    model = Qwen3ForCausalLM(Qwen3Config(**settings)).eval()
    shard = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **shard)
    if tokenizer:
        save_tiny_tokenizer(path, settings["vocab_size"])
    return path


def save_tiny_tokenizer(path: str | Path, vocab_size: int) -> Path:
    """A word-level tokenizer: the special tokens, then words w0, w1, ... up to vocab_size."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    path = Path(path)
    words = SPECIAL_TOKENS + [f"w{i}" for i in range(vocab_size - len(SPECIAL_TOKENS))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(SPECIAL_TOKENS)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config = {"chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>"}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def save_tiny_dflash(
    path: str | Path,
    target_dir: str | Path,
    seed: int = 1,
    block_size: int = 4,
    num_layers: int = 2,
    target_layer_ids: tuple[int, ...] = (0, 2),
    new_layout: bool = False,
    sliding_window: int | None = None,
    std: float = 0.2,
) -> Path:
    """A random DFlash drafter in the z-lab layout, sized for the target in `target_dir`.

    `new_layout` puts block_size in dflash_config and rope_theta in rope_parameters (the newer
    revisions); `sliding_window` makes every other layer a sliding-window layer.
    """
    path = Path(path)
    target = json.loads((Path(target_dir) / "config.json").read_text())
    hidden, heads, kv_heads, head_dim = (
        target["hidden_size"],
        target["num_attention_heads"],
        target["num_key_value_heads"],
        target["head_dim"],
    )
    inter = target["intermediate_size"]
    config = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": 1e-6,
        "vocab_size": target["vocab_size"],
        "num_target_layers": target["num_hidden_layers"],
        "dflash_config": {"mask_token_id": 0, "target_layer_ids": list(target_layer_ids)},
    }
    if new_layout:
        config["dflash_config"]["block_size"] = block_size
        config["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    else:
        config["block_size"] = block_size
        config["rope_theta"] = 10000.0
    if sliding_window:
        config["sliding_window"] = sliding_window
        config["layer_types"] = [
            "sliding_attention" if i % 2 else "full_attention" for i in range(num_layers)
        ]
    shapes = {
        "fc.weight": (hidden, hidden * len(target_layer_ids)),
        "hidden_norm.weight": (hidden,),
        "norm.weight": (hidden,),
    }
    for i in range(num_layers):
        p = f"layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
            p + "self_attn.q_norm.weight": (head_dim,),
            p + "self_attn.k_norm.weight": (head_dim,),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
        }
    gen = torch.Generator().manual_seed(seed)
    tensors = {
        name: (1 + 0.1 * torch.randn(shape, generator=gen))
        if name.endswith("norm.weight")
        else std * torch.randn(shape, generator=gen)
        for name, shape in shapes.items()
    }
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path
