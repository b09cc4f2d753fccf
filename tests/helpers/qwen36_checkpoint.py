"""Checkpoints in the exact layout of Qwen/Qwen3.6-27B, at chosen widths, for loading tests.

    from tests.helpers.qwen36_checkpoint import QWEN36_27B_WIDTHS, save_qwen36_checkpoint
    path = save_qwen36_checkpoint(tmp_path / "q", layers=4, vocab_size=32768, **QWEN36_27B_WIDTHS)

The layout is the real checkpoint's: a `qwen3_5` config.json with `text_config` and
`vision_config`; text tensors under `model.language_model.`, a vision tower under
`model.visual.`, multi-token-prediction tensors under `mtp.`, an untied `lm_head.weight`; the
tensors spread over several `model-0000i-of-0000n.safetensors` shards named by
`model.safetensors.index.json`. Tensor names and shapes come from transformers'
Qwen3_5ForConditionalGeneration built on the meta device (nothing is allocated for it); the
values are random (seeded per tensor name, so `shards=1`, a single `model.safetensors`, holds
the same values as a sharded copy) and written one shard at a time, so writing a 27B-width
checkpoint never holds more than one shard in memory.

`python -m tests.helpers.qwen36_checkpoint DIR [--layers 4] [--vocab 32768] [--shards 4]`
writes one at the 27B widths.
"""

from __future__ import annotations

import argparse
import json
import zlib
from pathlib import Path

import torch
from safetensors.torch import save_file

QWEN36_27B_WIDTHS = dict(
    hidden_size=5120,
    intermediate_size=17408,
    num_attention_heads=24,
    num_key_value_heads=4,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=48,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
)
SMALL_WIDTHS = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
)
TEXT_PREFIX = "model.language_model."
MTP_PREFIX = "mtp."


def qwen36_config(layers: int, vocab_size: int, **widths) -> dict:
    """The `qwen3_5` config.json: every 4th layer full attention (the last one if fewer), a
    small one-block vision tower (its names are the real ones; a text engine never reads it)."""
    from transformers import Qwen3_5Config

    layer_types = [
        "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)
    ]
    if "full_attention" not in layer_types:
        layer_types[-1] = "full_attention"
    text = dict(
        vocab_size=vocab_size,
        num_hidden_layers=layers,
        layer_types=layer_types,
        max_position_embeddings=262144,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
        tie_word_embeddings=False,
        eos_token_id=2,
        **widths,
    )
    vision = dict(
        depth=1,
        hidden_size=64,
        intermediate_size=128,
        num_heads=2,
        num_position_embeddings=64,
        out_hidden_size=widths["hidden_size"],
    )
    config = Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=False)
    raw = config.to_dict()
    raw["architectures"] = ["Qwen3_5ForConditionalGeneration"]
    return raw


def checkpoint_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor name of the checkpoint and its shape: transformers' own names (built on
    meta), plus one multi-token-prediction layer shaped like a full-attention text layer."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    with torch.device("meta"):
        model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(**config))
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    text = config["text_config"]
    attention_layer = text["layer_types"].index("full_attention")
    layer_prefix = f"{TEXT_PREFIX}layers.{attention_layer}."
    hidden = text["hidden_size"]
    shapes[MTP_PREFIX + "fc.weight"] = (hidden, 2 * hidden)
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        shapes[f"{MTP_PREFIX}{norm}.weight"] = (hidden,)
    for name, shape in list(shapes.items()):
        if name.startswith(layer_prefix):
            shapes[MTP_PREFIX + "layers.0." + name[len(layer_prefix) :]] = shape
    return shapes


def random_tensor(name: str, shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A value that keeps a random model numerically tame, the same for a name and seed."""
    generator = torch.Generator().manual_seed(zlib.crc32(name.encode()) ^ seed)
    if name.endswith("A_log"):
        return torch.empty(shape).uniform_(0, 2.7, generator=generator).to(dtype)
    if name.endswith("dt_bias"):
        return torch.ones(shape, dtype=dtype)
    if name.endswith("linear_attn.norm.weight"):  # scales by weight (not 1 + weight)
        return (1 + 0.1 * torch.randn(shape, generator=generator)).to(dtype)
    std = 0.1 if len(shape) == 1 or name.endswith("conv1d.weight") else 0.02
    return (std * torch.randn(shape, generator=generator)).to(dtype)


def assign_shards(shapes: dict[str, tuple[int, ...]], shards: int) -> list[list[str]]:
    """Names split into `shards` consecutive groups of roughly equal element counts."""
    sizes = {name: max(1, int(torch.Size(shape).numel())) for name, shape in shapes.items()}
    per_shard = -(-sum(sizes.values()) // shards)
    groups: list[list[str]] = [[]]
    filled = 0
    for name, size in sizes.items():
        if filled >= per_shard and len(groups) < shards:
            groups.append([])
            filled = 0
        groups[-1].append(name)
        filled += size
    return groups


def save_qwen36_checkpoint(
    path: str | Path,
    layers: int = 4,
    vocab_size: int = 32768,
    shards: int = 4,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    **widths,
) -> Path:
    """Write the checkpoint (config.json, shards, index); `widths` default to SMALL_WIDTHS."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = qwen36_config(layers, vocab_size, **{**SMALL_WIDTHS, **widths})
    shapes = checkpoint_shapes(config)
    groups = assign_shards(shapes, shards)
    files = (
        ["model.safetensors"]
        if len(groups) == 1
        else [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    )
    weight_map, total = {}, 0
    for file, names in zip(files, groups, strict=True):
        tensors = {name: random_tensor(name, shapes[name], dtype, seed) for name in names}
        save_file(tensors, str(path / file), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map |= dict.fromkeys(names, file)
        del tensors
    if len(files) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def text_weight_bytes(path: str | Path) -> int:
    """Bytes of the tensors a text engine uses (the language model and lm_head) in `path`."""
    from safetensors import safe_open

    total = 0
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():  # noqa: SIM118 (a safe_open handle, not a dict)
                if name.startswith(TEXT_PREFIX) or name == "lm_head.weight":
                    piece = f.get_slice(name)
                    numel = int(torch.Size(piece.get_shape()).numel())
                    total += numel * _itemsize(piece.get_dtype())
    return total


def _itemsize(safetensors_dtype: str) -> int:
    return {"BF16": 2, "F16": 2, "F32": 4, "F64": 8}[safetensors_dtype]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--shards", type=int, default=4)
    args = parser.parse_args()
    save_qwen36_checkpoint(args.path, args.layers, args.vocab, args.shards, **QWEN36_27B_WIDTHS)
    print(f"{args.path}: {text_weight_bytes(args.path) / 2**30:.2f} GiB of text weights")
