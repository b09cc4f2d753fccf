"""The GPU side of the memory plan, at Qwen3.6-27B's layer widths (run by engine.tools.gpu_check).

1. Load: a checkpoint in Qwen3.6-27B's layout (`qwen3_5` config, `model.language_model.*`,
   untied `lm_head.weight`, several shards with an index; random bf16 values) of `layers` layers
   at the real widths and vocabulary is written to a temporary directory and loaded onto the
   GPU; the peak of torch.cuda.max_memory_allocated() during the load must stay within
   LOAD_PEAK_LIMIT (1.05x) of the weights' bytes.
2. Prefill: that model prefills a `prompt`-token prompt (32k by default) in 2048-token chunks
   through `extend`, exactly as decoding does; the peak allocated must stay within the plan's
   total for that context (engine/memory_plan.py, less its runtime reserve, which is for what
   max_memory_allocated does not count: the CUDA context, the allocator's slack), and the
   measured transient (peak less weights, caches and state) is reported next to the plan's.

    python -m engine.tools.gpu_memory [--layers 4] [--prompt 32768]   # or via gpu_check
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.memory_plan import FULL, GIB, hybrid_layer_types, plan_from_configs
from engine.models.qwen3_5 import Qwen3_5Config, Qwen3_5Model, load_qwen3_5

LOAD_PEAK_LIMIT = 1.05
SHARD_BYTES = 2 * GIB
TEXT_PREFIX = "model.language_model."


def stack_config(layers: int, vocab: int = 248320, **widths: int) -> dict:
    """A `qwen3_5` config.json of `layers` layers at Qwen3.6-27B's widths (every 4th attention),
    or at `widths` (text_config keys: a tiny stack for a CPU test)."""
    text = {
        "model_type": "qwen3_5_text",
        "vocab_size": vocab,
        "hidden_size": 5120,
        "intermediate_size": 17408,
        "num_hidden_layers": layers,
        "full_attention_interval": 4,
        "num_attention_heads": 24,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 48,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "max_position_embeddings": 262144,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 1e7,
            "partial_rotary_factor": 0.25,
        },
        "tie_word_embeddings": False,
        **widths,
    }
    if FULL not in hybrid_layer_types(text):  # fewer than 4 layers: the last one attends
        text["layer_types"] = [*hybrid_layer_types(text)[:-1], FULL]
    return {"model_type": "qwen3_5", "tie_word_embeddings": False, "text_config": text}


def write_checkpoint(path: Path, config: dict, device: torch.device) -> int:
    """Random bf16 weights (drawn on `device`) in the real layout; returns the bytes written."""
    with torch.device("meta"):
        shapes = {
            n: p.shape for n, p in Qwen3_5Model(Qwen3_5Config.from_hf(config)).named_parameters()
        }
    weight_map, shard, filled, total, files = {}, {}, 0, 0, []

    def flush() -> None:
        name = f"model-{len(files) + 1:05d}.safetensors"
        save_file(shard, str(path / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
        files.append(name)

    for name, shape in shapes.items():
        key = name if name == "lm_head.weight" else TEXT_PREFIX + name
        tensor = (0.02 * torch.randn(shape, device=device, dtype=torch.bfloat16)).cpu()
        shard[key] = tensor
        filled += tensor.numel() * 2
        total += tensor.numel() * 2
        if filled >= SHARD_BYTES:
            flush()
            shard, filled = {}, 0
    if shard:
        flush()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    (path / "config.json").write_text(json.dumps(config))
    return total


def check_memory(device: torch.device, layers: int, prompt: int) -> dict:
    """Both checks; a dict of figures with `passed`."""
    config = stack_config(layers)
    with tempfile.TemporaryDirectory(prefix="ddops-gpu-memory-") as tmp:
        weights = write_checkpoint(Path(tmp), config, device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        model = load_qwen3_5(tmp, torch.bfloat16, device)
        load_peak = torch.cuda.max_memory_allocated(device) - before
    plan = plan_from_configs(
        config, None, "bfloat16", torch.cuda.get_device_properties(device).total_memory
    )
    cache = model.new_cache(prompt + 1)
    held = torch.cuda.memory_allocated(device) - before  # weights, KV cache, GDN state
    torch.cuda.reset_peak_memory_stats(device)
    ids = torch.randint(0, config["text_config"]["vocab_size"], (prompt,), device=device)
    started = time.perf_counter()
    with torch.inference_mode():
        for start in range(0, prompt, plan.prefill_chunk):
            model.extend(ids[start : start + plan.prefill_chunk], cache)
    torch.cuda.synchronize(device)
    seconds = time.perf_counter() - started
    prefill_peak = torch.cuda.max_memory_allocated(device) - before
    planned = plan.total_bytes(prompt) - plan.reserve
    return {
        "layers": layers,
        "weights_bytes": weights,
        "load_peak_bytes": load_peak,
        "load_peak_ratio": round(load_peak / weights, 4),
        "prompt_tokens": prompt,
        "prefill_peak_bytes": prefill_peak,
        "prefill_transient_bytes": prefill_peak - held,
        "plan_transient_bytes": plan.transient,
        "plan_total_bytes": planned,
        "prefill_seconds": round(seconds, 2),
        "passed": load_peak <= LOAD_PEAK_LIMIT * weights and prefill_peak <= planned,
    }


def print_memory_report(report: dict) -> None:
    mib = 2**20
    print(f"memory ({report['layers']} layers at Qwen3.6-27B widths, bf16):")
    print(
        f"  load peak {report['load_peak_bytes'] / mib:.0f} MiB = {report['load_peak_ratio']}x "
        f"the weights ({report['weights_bytes'] / mib:.0f} MiB; limit {LOAD_PEAK_LIMIT}x)"
    )
    print(
        f"  {report['prompt_tokens']}-token prefill: peak {report['prefill_peak_bytes'] / mib:.0f} "
        f"MiB (plan {report['plan_total_bytes'] / mib:.0f} MiB), transient "
        f"{report['prefill_transient_bytes'] / mib:.0f} MiB (plan "
        f"{report['plan_transient_bytes'] / mib:.0f} MiB), {report['prefill_seconds']} s"
    )
    print(f"  {'ok' if report['passed'] else 'FAIL'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=32768)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_memory: no CUDA device: nothing to check", file=sys.stderr)
        return 2
    report = check_memory(torch.device("cuda"), args.layers, args.prompt)
    print_memory_report(report)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
