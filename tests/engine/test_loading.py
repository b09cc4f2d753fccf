"""Loading checkpoints tensor by tensor, in the target dtype (engine/models/common.py).

    python -m pytest -q tests/engine/test_loading.py            # fast: small widths
    python -m pytest -q --slow tests/engine/test_loading.py     # + peak RSS at the 27B widths

On a checkpoint in Qwen3.6-27B's exact layout (tests/helpers/qwen36_checkpoint.py): every
parameter equals its checkpoint tensor cast to the dtype, the vision tower and `mtp.*` are never
read, a sharded checkpoint decodes what the same tensors in one file decode, and (slow) a
bfloat16 `python -m engine generate` at the 27B layer widths peaks at <= 1.25x the text weights'
bytes of resident memory above its imports.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine.decode import GenerationConfig, generate
from engine.models import load_drafter, load_target
from tests.helpers import REPO
from tests.helpers.checkpoint_reads import record_reads
from tests.helpers.qwen36_checkpoint import (
    QWEN36_27B_WIDTHS,
    TEXT_PREFIX,
    save_qwen36_checkpoint,
    text_weight_bytes,
)
from tests.helpers.tiny_qwen3 import save_tiny_dflash, save_tiny_qwen3

PEAK_OVER_WEIGHTS = 1.25


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    return save_qwen36_checkpoint(tmp_path_factory.mktemp("sharded"), layers=4, shards=3)


def checkpoint_tensors(path: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(path.glob("*.safetensors")):
        tensors |= load_file(str(file))
    return tensors


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_multimodal_layout_loads_each_text_tensor_in_the_dtype_and_nothing_else(
    sharded, monkeypatch, dtype
):
    reads = record_reads(monkeypatch).names
    model = load_target(sharded, dtype)
    tensors = checkpoint_tensors(sharded)
    params = dict(model.named_parameters())
    expected = {
        name[len(TEXT_PREFIX) :]: t for name, t in tensors.items() if name.startswith(TEXT_PREFIX)
    }
    expected["lm_head.weight"] = tensors["lm_head.weight"]
    assert set(params) == set(expected)
    for name, param in params.items():
        assert param.dtype == dtype
        assert torch.equal(param, expected[name].to(dtype)), name
    assert sorted(reads) == sorted(
        n for n in tensors if n.startswith(TEXT_PREFIX) or n == "lm_head.weight"
    )
    assert any(n.startswith("model.visual.") for n in tensors)
    assert any(n.startswith("mtp.") for n in tensors)


def test_sharded_checkpoint_decodes_like_the_same_tensors_in_one_file(tmp_path, sharded):
    single = save_qwen36_checkpoint(tmp_path / "single", layers=4, shards=1)
    assert not (single / "model.safetensors.index.json").exists()
    cfg = GenerationConfig(method="ar", max_new_tokens=8)
    outputs = [
        generate(load_target(p), None, [5, 9, 17, 3], cfg).output_ids for p in (sharded, single)
    ]
    assert outputs[0] == outputs[1]


def test_dense_and_drafter_load_each_tensor_in_the_dtype(tmp_path):
    target_dir = save_tiny_qwen3(tmp_path / "t", max_shard_size="20KB", tokenizer=False)
    draft_dir = save_tiny_dflash(tmp_path / "d", target_dir)
    assert (target_dir / "model.safetensors.index.json").exists()
    target = load_target(target_dir, torch.bfloat16)
    drafter = load_drafter(draft_dir, torch.bfloat16)
    for model, path, prefix in ((target, target_dir, "model."), (drafter, draft_dir, "")):
        tensors = {k.removeprefix(prefix): v for k, v in checkpoint_tensors(path).items()}
        for name, param in model.named_parameters():
            assert param.dtype == torch.bfloat16
            assert torch.equal(param, tensors[name].to(torch.bfloat16)), name


LOAD = """
import sys
from engine.models import load_drafter, load_target
load_target(sys.argv[1])
if len(sys.argv) > 2:
    load_drafter(sys.argv[2])
print(sorted(name for name in sys.modules if name.startswith("torch._dynamo")))
"""


def test_loading_the_models_never_imports_torch_dynamo(tmp_path, sharded):
    """torch._dynamo costs 1.4 s of every engine start (so of reboot -> healthy engine) on
    this machine: building the models on the meta device must not pull it in."""
    dense = save_tiny_qwen3(tmp_path / "t", tokenizer=False)
    draft = save_tiny_dflash(tmp_path / "d", dense)
    for models in ([sharded], [dense, draft]):
        run = [sys.executable, "-c", LOAD, *map(str, models)]
        loaded = subprocess.run(run, cwd=REPO, capture_output=True, text=True, check=True)
        assert loaded.stdout.strip() == "[]", loaded.stdout


def test_a_missing_tensor_is_named(tmp_path):
    path = save_tiny_qwen3(tmp_path / "t", tokenizer=False)
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.norm.weight"]
    from safetensors.torch import save_file

    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="missing \\['norm.weight'\\]"):
        load_target(path)


def generate_ids(path: Path, dtype: str, measure: bool = False) -> list[int] | tuple:
    """Output ids of a greedy `python -m engine generate` (and its peak-RSS report)."""
    module = ["-m", "tests.helpers.peak_rss"] if measure else ["-m", "engine"]
    command = [sys.executable, *module, "generate", "--model", str(path), "--method", "ar"]
    command += ["--prompt-ids", "5,9,17,3", "--max-new-tokens", "4", "--dtype", dtype]
    done = subprocess.run(
        [*command, "--device", "cpu", "--json"], capture_output=True, text=True, cwd=REPO
    )
    assert done.returncode == 0, done.stderr
    ids = json.loads(done.stdout)["output_ids"]
    return (ids, json.loads(done.stderr.strip().splitlines()[-1])) if measure else ids


@pytest.mark.slow
def test_bfloat16_generate_at_27b_widths_peaks_within_its_weights(tmp_path):
    """About a minute: writes two 2-layer checkpoints at the real widths (~2.3 GB each)."""
    sharded = save_qwen36_checkpoint(
        tmp_path / "sharded", layers=2, vocab_size=16384, shards=4, **QWEN36_27B_WIDTHS
    )
    ids, report = generate_ids(sharded, "bfloat16", measure=True)
    weights = text_weight_bytes(sharded)
    assert report["extra_bytes"] <= PEAK_OVER_WEIGHTS * weights, (report, weights)
    single = save_qwen36_checkpoint(
        tmp_path / "single", layers=2, vocab_size=16384, shards=1, **QWEN36_27B_WIDTHS
    )
    assert generate_ids(single, "bfloat16") == ids


def test_gpu_memory_check_writes_a_loadable_real_layout_checkpoint(tmp_path, monkeypatch):
    """The checkpoint gpu_check loads on a GPU, written and loaded here at small widths."""
    from engine.tools import gpu_memory

    config = gpu_memory.stack_config(layers=2, vocab=64)
    config["text_config"].update(hidden_size=32, intermediate_size=64, head_dim=16)
    config["text_config"].update(num_attention_heads=4, num_key_value_heads=2)
    config["text_config"].update(linear_num_key_heads=2, linear_num_value_heads=4)
    config["text_config"].update(linear_key_head_dim=8, linear_value_head_dim=8)
    monkeypatch.setattr(gpu_memory, "SHARD_BYTES", 20_000)  # several shards
    written = gpu_memory.write_checkpoint(tmp_path, config, torch.device("cpu"))
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    model = load_target(tmp_path, torch.bfloat16)
    assert [layer.layer_type for layer in model.layers] == ["linear_attention", "full_attention"]
    assert written == sum(p.numel() * 2 for p in model.parameters())
    assert gpu_memory.main([]) == 2  # no CUDA here: nothing is run
