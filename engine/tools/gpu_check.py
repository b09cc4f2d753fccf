"""GPU check of the Triton tree kernels: correctness against the references, verify-vs-decode time.

Run on a CUDA machine (about 2 minutes on an H200 before the memory check, well under 8):

    python -m engine.tools.gpu_check [--out gpu_check.json] [--layers 4] [--prefix 4096] \\
        [--memory-layers 4] [--memory-prompt 32768]

1. Correctness: each Triton kernel against its reference (engine/kernels/reference.py), both on
   CUDA, at Qwen3.6-27B layer shapes, float32 and bf16 (float64 at a small shape), on several
   16-token trees (chain, all roots, wide, random).
2. Kernel times: each kernel on a 16-token tree vs a single token (Triton and reference).
3. Layer times: a stack of Qwen3.6-27B-shaped layers (3 Gated DeltaNet + 1 gated attention per
   4, random bf16 weights, real sizes) running one verify of a 16-token tree vs one decode
   step, with the Triton kernels and with the references (DDOPS_KERNELS=reference).
4. Memory (engine/tools/gpu_memory.py): loading a Qwen3.6-27B-layout checkpoint of
   --memory-layers layers peaks within 1.05x its weights, and a --memory-prompt-token prefill
   (32k) on it stays within the memory plan (engine/plan.py). --memory-layers 0 skips it.

Prints a report and writes it as JSON with --out. Exit status: 0 all checks passed, 1 a check
failed, 2 no CUDA device or no triton (nothing was run).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine import kernels
from engine.kernels import reference
from engine.tools.gpu_memory import check_memory, print_memory_report

# Qwen3.6-27B text config (config.json "text_config").
HIDDEN = 5120
INTERMEDIATE = 17408
ATTN_Q_HEADS, ATTN_KV_HEADS, ATTN_HEAD_DIM, ROTARY_DIM = 24, 4, 256, 64  # partial RoPE 0.25
GDN_K_HEADS, GDN_V_HEADS, GDN_HEAD_DIM, CONV_KERNEL = 16, 48, 128, 4
GDN_KEY_DIM = GDN_K_HEADS * GDN_HEAD_DIM  # 2048
GDN_VALUE_DIM = GDN_V_HEADS * GDN_HEAD_DIM  # 6144
GDN_CONV_DIM = 2 * GDN_KEY_DIM + GDN_VALUE_DIM  # 10240: conv over [q ; k ; v]
VERIFY_TOKENS = 16  # DDTree budget 15 + the bonus root

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float64: 1e-10}


# --- kernel inputs ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Sizes:
    """The kernel shapes of one layer: Gated DeltaNet heads, conv channels, attention heads."""

    delta_heads: int
    delta_head_dim: int
    conv_channels: int
    q_heads: int
    kv_heads: int
    attn_head_dim: int


QWEN36 = Sizes(GDN_V_HEADS, GDN_HEAD_DIM, GDN_CONV_DIM, ATTN_Q_HEADS, ATTN_KV_HEADS, ATTN_HEAD_DIM)
SMALL = Sizes(4, 32, 64, 4, 2, 32)

_TRITON_MODULES = {
    "tree_gated_delta_rule": "engine.kernels.triton_gated_delta",
    "tree_causal_conv1d": "engine.kernels.triton_conv",
    "tree_attention": "engine.kernels.triton_attention",
}


def _trees(T: int, device: torch.device) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    shapes = {
        "chain": list(range(-1, T - 1)),
        "all_roots": [-1] * T,
        "wide": [-1] + [0] * (T - 1),
        "random": [int(torch.randint(-1, i, (1,), generator=gen)) for i in range(T)],
    }
    return {name: torch.tensor(p, dtype=torch.int64, device=device) for name, p in shapes.items()}


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:  # [T, T] bool
    """visible[i, j]: j is i or one of its ancestors."""
    T = parents.shape[0]
    visible = torch.eye(T, dtype=torch.bool, device=parents.device)
    for i, parent in enumerate(parents.tolist()):
        if parent >= 0:
            visible[i] |= visible[parent]
    return visible


def kernel_calls(
    parents: torch.Tensor, sizes: Sizes, prefix: int, dtype: torch.dtype, causal: bool = False
) -> dict[str, tuple[str, tuple]]:
    """Random inputs for each kernel on one tree: {label: (kernel name, positional args)}."""
    T, device = parents.shape[0], parents.device
    H, D = sizes.delta_heads, sizes.delta_head_dim

    def randn(*shape: int, std: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, device=device) * std).to(dtype)

    q = F.normalize(torch.randn(T, H, D, device=device), dim=-1).to(dtype)
    k = F.normalize(torch.randn(T, H, D, device=device), dim=-1).to(dtype)
    g = -torch.rand(T, H, device=device).to(dtype)  # log decay
    beta = torch.rand(T, H, device=device).to(dtype)
    delta = (q, k, randn(T, H, D), g, beta, parents, randn(H, D, D, std=0.1), D**-0.5)
    C = sizes.conv_channels
    conv = (randn(T, C), parents, randn(C, CONV_KERNEL - 1), randn(C, CONV_KERNEL, std=0.5), None)
    Hkv, Dh = sizes.kv_heads, sizes.attn_head_dim
    visible = None if causal else ancestor_mask(parents)
    attention = (
        randn(T, sizes.q_heads, Dh),
        randn(prefix + T, Hkv, Dh),
        randn(prefix + T, Hkv, Dh),
        prefix,
        visible,
        Dh**-0.5,
    )
    return {
        "gated_delta": ("tree_gated_delta_rule", delta),
        "gated_delta+states": ("tree_gated_delta_rule", (*delta, True)),
        "conv1d": ("tree_causal_conv1d", conv),
        "attention" + ("(causal)" if causal else ""): ("tree_attention", attention),
    }


# --- 1. correctness ---------------------------------------------------------------------------


@dataclass
class Comparison:
    kernel: str
    tree: str
    dtype: str
    max_abs_diff: float = float("nan")
    passed: bool = False  # every element within tolerance * (1 + |expected|)
    error: str | None = None


def _compare(kernel: str, tree: str, dtype: torch.dtype, actual, expected) -> Comparison:
    """Compare outputs (a tensor, or a tuple of tensors / None as the gated delta returns)."""
    pairs = (
        zip(actual, expected, strict=True) if isinstance(actual, tuple) else [(actual, expected)]
    )
    pairs = [(a.double(), e.double()) for a, e in pairs if a is not None]
    tol = TOLERANCE[dtype]
    return Comparison(
        kernel,
        tree,
        str(dtype).removeprefix("torch."),
        max_abs_diff=max((a - e).abs().max().item() for a, e in pairs),
        passed=all(torch.allclose(a, e, rtol=tol, atol=tol) for a, e in pairs),
    )


def check_correctness(device: torch.device, prefix: int) -> list[Comparison]:
    """Each Triton kernel vs its reference on CUDA: Qwen3.6 shapes in fp32 / bf16, small fp64."""
    plans = [
        (torch.float32, QWEN36, VERIFY_TOKENS, prefix),
        (torch.bfloat16, QWEN36, VERIFY_TOKENS, prefix),
        (torch.float64, SMALL, 5, 37),
    ]
    results = []
    for dtype, sizes, T, prefix_len in plans:
        torch.manual_seed(0)
        for tree, parents in _trees(T, device).items():
            calls = kernel_calls(parents, sizes, prefix_len, dtype, causal=tree == "chain")
            for label, (name, args) in calls.items():
                triton_fn = getattr(importlib.import_module(_TRITON_MODULES[name]), name)
                try:
                    expected = getattr(reference, name)(*args)
                    results.append(_compare(label, tree, dtype, triton_fn(*args), expected))
                except Exception as exc:  # the report names it, and the other checks still run
                    dtype_name = str(dtype).removeprefix("torch.")
                    results.append(Comparison(label, tree, dtype_name, error=repr(exc)))
    return results


# --- 2. kernel times --------------------------------------------------------------------------


def time_ms(fn: Callable[[], object]) -> float:
    """Median milliseconds of fn on the GPU (triton's do_bench: warm-up, L2 flush)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")


@contextlib.contextmanager
def kernel_backend(choice: str) -> Iterator[None]:
    """Run the engine.kernels dispatch with DDOPS_KERNELS=choice inside the block."""
    before = os.environ.get(kernels.BACKEND_ENV)
    os.environ[kernels.BACKEND_ENV] = choice
    try:
        yield
    finally:
        if before is None:
            del os.environ[kernels.BACKEND_ENV]
        else:
            os.environ[kernels.BACKEND_ENV] = before


def time_kernels(device: torch.device, prefix: int) -> dict[str, dict[str, float]]:
    """ms per call of each kernel on a random 16-token tree and on one token (bf16, Qwen3.6)."""
    rows: dict[str, dict[str, float]] = {}
    for T in (VERIFY_TOKENS, 1):
        parents = _trees(T, device)["random"]
        calls = kernel_calls(parents, QWEN36, prefix, torch.bfloat16)
        for backend, column in (("auto", "triton"), ("reference", "reference")):
            with kernel_backend(backend):
                for label, (name, args) in calls.items():
                    fn = getattr(kernels, name)
                    rows.setdefault(label, {})[f"{column} T={T}"] = time_ms(
                        lambda f=fn, a=args: f(*a)
                    )
    return rows


# --- 3. a Qwen3.6-27B-shaped layer stack ------------------------------------------------------


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def _linear(in_features: int, out_features: int, device, dtype) -> torch.Tensor:
    return torch.randn(out_features, in_features, device=device, dtype=dtype) * in_features**-0.5


class _Mlp:
    def __init__(self, device, dtype):
        self.gate_up = _linear(HIDDEN, 2 * INTERMEDIATE, device, dtype)  # [2I, H]
        self.down = _linear(INTERMEDIATE, HIDDEN, device, dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [T, H]
        gate, up = (x @ self.gate_up.T).chunk(2, dim=-1)  # [T, I] each
        return (F.silu(gate) * up) @ self.down.T


class GatedDeltaNetLayer:
    """A Qwen3.6 Gated DeltaNet block (random weights) on the tree kernels: conv, delta rule."""

    def __init__(self, device, dtype):
        self.qkvz = _linear(HIDDEN, GDN_CONV_DIM + GDN_VALUE_DIM, device, dtype)
        self.ba = _linear(HIDDEN, 2 * GDN_V_HEADS, device, dtype)
        self.conv_weight = torch.randn(GDN_CONV_DIM, CONV_KERNEL, device=device, dtype=dtype) * 0.5
        self.a_log = torch.rand(GDN_V_HEADS, device=device).log()
        self.dt_bias = torch.zeros(GDN_V_HEADS, device=device)
        self.out = _linear(GDN_VALUE_DIM, HIDDEN, device, dtype)
        self.mlp = _Mlp(device, dtype)
        self.conv_state = torch.zeros(GDN_CONV_DIM, CONV_KERNEL - 1, device=device, dtype=dtype)
        self.state = torch.zeros(GDN_V_HEADS, GDN_HEAD_DIM, GDN_HEAD_DIM, device=device)
        self.ones = torch.ones(HIDDEN, device=device, dtype=dtype)

    def __call__(self, x: torch.Tensor, tree: Tree) -> torch.Tensor:  # [T, H]
        T, parents = x.shape[0], tree.parents
        h = _rms_norm(x, self.ones)
        mixed, z = (h @ self.qkvz.T).split([GDN_CONV_DIM, GDN_VALUE_DIM], dim=-1)
        b, a = (h @ self.ba.T).chunk(2, dim=-1)  # [T, Hv] each
        mixed = kernels.tree_causal_conv1d(mixed, parents, self.conv_state, self.conv_weight, None)
        q, k, v = mixed.split([GDN_KEY_DIM, GDN_KEY_DIM, GDN_VALUE_DIM], dim=-1)
        repeat = GDN_V_HEADS // GDN_K_HEADS
        q = F.normalize(q.view(T, GDN_K_HEADS, -1).float(), dim=-1).repeat_interleave(repeat, 1)
        k = F.normalize(k.view(T, GDN_K_HEADS, -1).float(), dim=-1).repeat_interleave(repeat, 1)
        g = -self.a_log.exp() * F.softplus(a.float() + self.dt_bias)  # [T, Hv]
        o, _ = kernels.tree_gated_delta_rule(
            q.to(x.dtype), k.to(x.dtype), v.view(T, GDN_V_HEADS, -1), g, b.float().sigmoid(),
            parents, self.state, GDN_HEAD_DIM**-0.5,
        )  # fmt: skip
        o = _rms_norm(o, self.ones[:GDN_HEAD_DIM]) * F.silu(z.view(T, GDN_V_HEADS, -1))
        x = x + o.reshape(T, GDN_VALUE_DIM) @ self.out.T
        return x + self.mlp(_rms_norm(x, self.ones))


def _rotate(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:  # [T, heads, D]
    """RoPE on the first ROTARY_DIM dims (partial rotary, theta 1e7)."""
    half = ROTARY_DIM // 2
    freqs = 1e7 ** (-torch.arange(half, device=x.device) / half)  # [half]
    angles = positions[:, None].float() * freqs  # [T, half]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x1, x2, rest = x[..., :half].float(), x[..., half:ROTARY_DIM].float(), x[..., ROTARY_DIM:]
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
    return torch.cat([rotated, rest], dim=-1)


@dataclass(frozen=True)
class Tree:
    """What a verify pass derives from `parents` once, before the layers run."""

    parents: torch.Tensor  # [T] int64
    visible: torch.Tensor  # [T, T] bool, ancestor mask
    positions: torch.Tensor  # [T] int64, prefix + depth
    prefix: int

    @classmethod
    def of(cls, parents: torch.Tensor, prefix: int) -> Tree:
        visible = ancestor_mask(parents)
        depth = visible.sum(dim=1) - 1  # ancestors of a node = its depth
        return cls(parents, visible, prefix + depth, prefix)


class GatedAttentionLayer:
    """A Qwen3.6 gated full-attention block (random weights) on the tree attention kernel."""

    def __init__(self, device, dtype, max_len: int):
        q_dim, kv_dim = ATTN_Q_HEADS * ATTN_HEAD_DIM, ATTN_KV_HEADS * ATTN_HEAD_DIM
        self.qkv = _linear(HIDDEN, 2 * q_dim + 2 * kv_dim, device, dtype)  # q and its gate
        self.out = _linear(q_dim, HIDDEN, device, dtype)
        self.mlp = _Mlp(device, dtype)
        shape = (max_len, ATTN_KV_HEADS, ATTN_HEAD_DIM)
        self.k_cache = torch.randn(shape, device=device, dtype=dtype)
        self.v_cache = torch.randn(shape, device=device, dtype=dtype)
        self.ones = torch.ones(HIDDEN, device=device, dtype=dtype)

    def __call__(self, x: torch.Tensor, tree: Tree) -> torch.Tensor:  # [T, H]
        T, prefix = x.shape[0], tree.prefix
        q_dim, kv_dim = ATTN_Q_HEADS * ATTN_HEAD_DIM, ATTN_KV_HEADS * ATTN_HEAD_DIM
        h = _rms_norm(x, self.ones)
        q, gate, k, v = (h @ self.qkv.T).split([q_dim, q_dim, kv_dim, kv_dim], dim=-1)
        head_norm = self.ones[:ATTN_HEAD_DIM]
        q = _rotate(_rms_norm(q.view(T, ATTN_Q_HEADS, -1), head_norm), tree.positions)
        k = _rotate(_rms_norm(k.view(T, ATTN_KV_HEADS, -1), head_norm), tree.positions)
        self.k_cache[prefix : prefix + T] = k
        self.v_cache[prefix : prefix + T] = v.view(T, ATTN_KV_HEADS, -1)
        o = kernels.tree_attention(
            q, self.k_cache[: prefix + T], self.v_cache[: prefix + T], prefix, tree.visible,
            ATTN_HEAD_DIM**-0.5,
        )  # fmt: skip
        o = o.reshape(T, q_dim) * gate.sigmoid()
        x = x + o @ self.out.T
        return x + self.mlp(_rms_norm(x, self.ones))


def build_stack(n_layers: int, device, dtype, max_len: int) -> list:
    """Every 4th layer full attention, the others Gated DeltaNet (as in Qwen3.6-27B)."""
    return [
        GatedAttentionLayer(device, dtype, max_len)
        if i % 4 == 3
        else GatedDeltaNetLayer(device, dtype)
        for i in range(n_layers)
    ]


def time_stack(device: torch.device, n_layers: int, prefix: int) -> dict[str, float]:
    """ms for one verify of a 16-token tree vs one decode step through the layer stack."""
    dtype = torch.bfloat16
    torch.manual_seed(0)
    stack = build_stack(n_layers, device, dtype, prefix + VERIFY_TOKENS)
    tree = _trees(VERIFY_TOKENS, device)["random"]
    single = torch.tensor([-1], device=device)

    def run(parents: torch.Tensor) -> Callable[[], torch.Tensor]:
        x = torch.randn(parents.shape[0], HIDDEN, device=device, dtype=dtype) * 0.1

        def forward() -> torch.Tensor:
            h, shape = x, Tree.of(parents, prefix)
            for layer in stack:
                h = layer(h, shape)
            return h

        return forward

    times = {}
    for backend in ("auto", "reference"):
        label = "triton" if backend == "auto" else "reference"
        with kernel_backend(backend), torch.inference_mode():
            times[f"{label}: verify 16-token tree"] = time_ms(run(tree))
            times[f"{label}: decode step"] = time_ms(run(single))
    return times


# --- report -----------------------------------------------------------------------------------


def _no_device_reason() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    return None


def _print_report(report: dict) -> None:
    print(f"device: {report['device']}")
    for row in report["correctness"]:
        verdict = "ok  " if row["passed"] else "FAIL"
        detail = row["error"] or f"max|diff| {row['max_abs_diff']:.3g}"
        print(f"  {verdict} {row['kernel']:<20} {row['tree']:<10} {row['dtype']:<9} {detail}")
    print(f"kernel ms (bf16, random tree, attention prefix {report['prefix']}):")
    for name, cols in report["kernel_ms"].items():
        print(f"  {name:<26} " + "  ".join(f"{k} {v:.4f}" for k, v in cols.items()))
    print(f"layer stack ms ({report['layers']} layers, prefix {report['prefix']}, bf16):")
    for name, ms in report["stack_ms"].items():
        print(f"  {name:<36} {ms:.3f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the report as JSON to this file")
    parser.add_argument("--layers", type=int, default=4, help="layers in the timed stack")
    parser.add_argument("--prefix", type=int, default=4096, help="committed tokens before the tree")
    parser.add_argument("--memory-layers", type=int, default=4, help="0 skips the memory check")
    parser.add_argument("--memory-prompt", type=int, default=32768, help="prefill tokens")
    args = parser.parse_args(argv)
    if reason := _no_device_reason():
        print(f"gpu_check: {reason}: nothing to check", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    started = time.monotonic()
    comparisons = check_correctness(device, args.prefix)
    report = {
        "device": torch.cuda.get_device_name(device),
        "correctness": [vars(c) for c in comparisons],
        "kernel_ms": time_kernels(device, args.prefix),
        "layers": args.layers,
        "prefix": args.prefix,
        "stack_ms": time_stack(device, args.layers, args.prefix),
    }
    if args.memory_layers:
        report["memory"] = check_memory(device, args.memory_layers, args.memory_prompt)
    report["seconds"] = round(time.monotonic() - started, 1)
    _print_report(report)
    if "memory" in report:
        print_memory_report(report["memory"])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    memory_ok = report.get("memory", {}).get("passed", True)
    return 0 if memory_ok and all(c.passed for c in comparisons) else 1


if __name__ == "__main__":
    sys.exit(main())
