"""Our own compact model code: dense Qwen3, hybrid Qwen3.5/3.6, the DFlash drafter; HF-format loading.

`load_target(dir)` picks the model class from config.json's `model_type`;
`load_drafter(dir)` loads a z-lab-layout DFlash drafter.
"""

from __future__ import annotations

from pathlib import Path

import torch

from engine.models.common import read_config


def load_target(model_dir: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """The target model in `model_dir`, dispatched on config.json's model_type."""
    from engine.models.common import finish_loading

    model, rename = target_checkpoint(model_dir)
    return finish_loading(model, model_dir, rename, dtype, device)


def target_checkpoint(model_dir: str | Path):
    """(the target built on the meta device, the map from checkpoint tensor names to its
    parameter names) for `model_dir`, dispatched on config.json's model_type."""
    model_type = read_config(model_dir).get("model_type")
    if model_type == "qwen3":
        from engine.models.qwen3 import qwen3_checkpoint

        return qwen3_checkpoint(model_dir)
    if model_type in ("qwen3_5_text", "qwen3_5"):
        from engine.models.qwen3_5 import qwen3_5_checkpoint

        return qwen3_5_checkpoint(model_dir)
    raise ValueError(f"{model_dir}: unsupported target model_type {model_type!r}")


def load_drafter(model_dir: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """The DFlash drafter in `model_dir` (z-lab layout)."""
    from engine.models.dflash import load_dflash

    return load_dflash(model_dir, dtype, device)
