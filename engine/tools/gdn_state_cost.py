"""What one GDN layer's recurrent state costs a decode step, at a model's real widths (random
weights, one layer: only config.json is read).

    python -m engine.tools.gdn_state_cost --model DIR [--rows 1,6] [--tree 16] [--repeats 12] \\
        [--device cpu|cuda] [--json]

Per layer, the median seconds of:
- `single_steps`: a batched pass's one-token steps of `rows` sequences (engine/models/
  gated_deltanet.py; each row's conv window and delta-rule step against its own state);
- `commit_state`: a verify tree's commit installing the state after its accepted node
  (`TreeStates.write_state_after` of a `tree`-node chain, into the committed state);
beside the state's bytes (one sequence, one layer). At Qwen3.6-27B's widths (its 48 value heads
of 128 x 128, float32) the state is 3 MiB a layer and 144 MiB over its 48 GDN layers, so what a
step reads and writes of it, per sequence, is what these figures show. Exit status: 0 measured,
2 bad arguments or a config without GDN widths.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from functools import partial

import torch

from engine.kernels.batched import solve_tree
from engine.models.common import materialize, read_config
from engine.models.gated_deltanet import GatedDeltaNet, GDNShape
from engine.models.qwen3_5 import Qwen3_5Config
from engine.tools.parallel_measure import median_seconds

DTYPE = torch.bfloat16  # the checkpoints'; the recurrent state is float32 whatever the weights


def build_layer(shape: GDNShape, device: str) -> GatedDeltaNet:
    """One GDN layer of `shape`, random weights (built on meta: no float32 copy first)."""
    with torch.device("meta"):
        layer = GatedDeltaNet(shape)
    layer = materialize(layer, DTYPE, device)
    generator = torch.Generator(device).manual_seed(0)
    for parameter in layer.parameters():
        parameter.data.normal_(0.0, 0.02, generator=generator)
    return layer


def measure(shape: GDNShape, rows: list[int], tree: int, repeats: int, device: str) -> dict:
    layer = build_layer(shape, device)
    report = {"single_steps_s": {}, "device": device}
    with torch.no_grad():
        for count in rows:
            states = [layer.new_state(DTYPE, device) for _ in range(count)]
            for state in states:
                state.recurrent.normal_(0.0, 0.05)
            inputs = layer._inputs(
                torch.randn(count, shape.hidden_size, dtype=DTYPE, device=device)
            )
            step = partial(layer.single_steps, inputs, states)
            report["single_steps_s"][str(count)] = median_seconds(step, repeats, device)
        committed = layer.new_state(DTYPE, device).recurrent.normal_(0.0, 0.05)
        heads = shape.value_heads
        q, k = (
            torch.nn.functional.normalize(
                torch.randn(tree, heads, shape.key_dim, device=device), dim=-1
            )
            for _ in range(2)
        )
        v = torch.randn(tree, heads, shape.value_dim, device=device)
        g, beta = -torch.rand(tree, heads, device=device), torch.rand(tree, heads, device=device)
        chain = torch.arange(-1, tree - 1, device=device)
        _, solved = solve_tree(q, k, v, g, beta, chain, committed, shape.key_dim**-0.5)
        out = torch.empty_like(committed)
        write = partial(solved.write_state_after, tree - 1, out)
        report["commit_state_s"] = median_seconds(write, repeats, device)
    report["state_bytes"] = committed.numel() * committed.element_size()
    return report


def parse_rows(text: str) -> list[int]:
    try:
        rows = [int(part) for part in text.split(",")]
    except ValueError:
        rows = []
    if not rows or min(rows) < 1:
        raise argparse.ArgumentTypeError(f"--rows wants sequence counts >= 1, like 1,6: {text!r}")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a Qwen3.5/3.6 model dir (config.json)")
    parser.add_argument("--rows", type=parse_rows, default=[1, 6])
    parser.add_argument("--tree", type=int, default=16, help="nodes of the committed tree")
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.tree < 1 or args.repeats < 1:
        parser.error("--tree and --repeats must be >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    try:
        shape = Qwen3_5Config.from_hf(read_config(args.model)).gdn_shape()
    except (OSError, ValueError, KeyError, TypeError) as error:
        print(f"gdn_state_cost: {args.model}: not a Qwen3.5/3.6 config ({error})", file=sys.stderr)
        return 2
    report = {"shape": asdict(shape)} | measure(
        shape, args.rows, args.tree, args.repeats, args.device
    )
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"GDN state: {report['state_bytes'] / (1 << 20):.1f} MiB a layer a sequence")
    for rows, seconds in report["single_steps_s"].items():
        print(f"single_steps, {rows} rows: {seconds * 1e3:.2f} ms a layer")
    print(
        f"commit's state install ({args.tree}-node tree): {report['commit_state_s'] * 1e3:.2f} ms"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
