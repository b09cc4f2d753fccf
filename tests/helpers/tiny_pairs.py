"""A tiny dense or hybrid target with its DFlash drafter, loaded by the engine, for tests.

target, drafter = load_tiny_pair(tmp_path, "hybrid")
target_dir, draft_dir = save_byte_pair(tmp_path, "dense")  # with a byte-level tokenizer
"""

from __future__ import annotations

from pathlib import Path

import torch

from engine.models import load_drafter, load_target
from tests.helpers.tiny_hybrid import save_tiny_hybrid, save_tiny_hybrid_drafter
from tests.helpers.tiny_qwen3 import save_tiny_dflash, save_tiny_qwen3
from tests.helpers.tiny_tokenizer import BYTE_VOCAB_SIZE, save_byte_tokenizer

KINDS = ("dense", "hybrid")


def load_tiny_pair(root: Path, kind: str, seed: int = 3, dtype: torch.dtype = torch.float32):
    """(target, drafter) of a random tiny pair saved under `root`, loaded in `dtype`: `kind`
    "dense" (Qwen3) or "hybrid" (Qwen3.5); the drafter's seed is seed + 1."""
    if kind == "dense":
        target_dir = save_tiny_qwen3(root / "target", seed=seed, tokenizer=False)
        draft_dir = save_tiny_dflash(root / "draft", target_dir, seed=seed + 1)
    else:
        target_dir = save_tiny_hybrid(root / "target", seed=seed, tokenizer=False)
        draft_dir = save_tiny_hybrid_drafter(root / "draft", target_dir, seed=seed + 1)
    return load_target(target_dir, dtype=dtype), load_drafter(draft_dir, dtype=dtype)


def save_byte_pair(root: Path, kind: str, name: str = "target") -> tuple[Path, Path]:
    """(target, drafter) directories of a random tiny pair whose target carries the byte-level
    tokenizer (tests/helpers/tiny_tokenizer.py): `root/name` (its served model name) and
    `root/name-draft`."""
    save = save_tiny_qwen3 if kind == "dense" else save_tiny_hybrid
    target = save(root / name, vocab_size=BYTE_VOCAB_SIZE, tokenizer=False)
    save_byte_tokenizer(target)
    save_drafter = save_tiny_dflash if kind == "dense" else save_tiny_hybrid_drafter
    return target, save_drafter(root / f"{name}-draft", target)
