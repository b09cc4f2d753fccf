"""GPU check of the engine's kernels and rounds at Qwen3.6-27B shapes, each figure beside its target.

Run on a CUDA machine (sized to finish within 8 minutes on an H200 with the defaults):

    python -m engine.tools.gpu_check [--out gpu_check.json] [--only S,..|--skip S,..] \\
        [--deadline SECONDS] [--layers 4] [--prefix 4096] [--memory-layers 4] \\
        [--memory-prompt 32768] [--rounds-layers 4] [--batched-layers 4] [--batched-prefix 4096]

    # the batched figures alone (estimated 2-4 minutes on an H200; not yet run on CUDA):
    python -m engine.tools.gpu_batched [--layers 4] [--prefix 4096]

1. Correctness: each Triton kernel against its reference (engine/kernels/reference.py), both on
   CUDA, at Qwen3.6-27B shapes, float32 and bf16 (float64 at a small shape): the tree kernels on
   several 16-token trees (chain, all roots, wide, random; attention also over a whole cache with
   a device-side prefix length), the fused RMSNorm (+ residual), RoPE and SiLU-multiply.
2. Kernel times: each tree kernel on a 16-token tree vs a single token (Triton and reference).
3. Layer times: a stack of Qwen3.6-27B-shaped layers (3 Gated DeltaNet + 1 gated attention per
   4, random bf16 weights, real sizes, the engine's kernels) running one verify of a 16-token
   tree vs one decode step, with the Triton kernels and with the references.
4. Recompiles while the context grows: the stack's verify and decode at contexts from 64 to
   32k tokens, attention over a growing slice and over a whole cache with a device-side length;
   Triton compiles counted after the smallest and largest context ran (target 0).
5. Memory (engine/tools/gpu_memory.py): loading a Qwen3.6-27B-layout checkpoint of
   --memory-layers layers peaks within 1.05x its weights, and a --memory-prompt-token prefill
   (32k) on it stays within the memory plan (engine/memory_plan.py).
6. Rounds (engine/tools/gpu_rounds.py `check_rounds`, with --rounds-layers layers and twice as
   many): the ar step against the bandwidth floor, verify / step, host syncs per
   round, graphs vs eager, recompiles of whole generations as the prefix grows.
7. Batched (engine/tools/gpu_batched.py `check_batched`, --batched-layers and twice as
   many): aggregate tok/s and per-sequence inter-token latency at concurrency 1, 4, 8, 16
   for ar, ddtree:15 (and auto) through the scheduler, and the verify pass's cost by token count
   (the table a cost model uses), each also fitted to 64 layers; ar's and ddtree:15's tok/s with
   their steps replayed as CUDA graphs over eager at the highest concurrency (target >= 0.98:
   engine/step_passes.py, engine/tree_passes.py).
8. Ties (engine/tools/batch_ties.py `check_ties`): the demo pair in bf16 on CUDA, its chat
   prompts served at once and alone for ar, ddtree:15 and auto; every output that differs must
   differ at a near-tie (the two tokens' logits within a few bf16 ulps), and at least half of
   each method's outputs must be equal (~1 minute estimated).

The sections, in that order: correctness, kernels, stack, recompiles, memory, rounds, batched,
ties (`--only` or `--skip` some). Each is kept as soon as it ends (engine/tools/sections.py): a
line on stderr as each starts and ends, the report rewritten to --out after each, a section that
raises recorded and the next ones run, none started past --deadline seconds. So a device run
cut off at its time limit still returns what finished: give the machine's command a limit
above the deadline by the longest section's time.
Prints a report ending in every figure beside its target. Exit status: 0 every figure met its
target, 1 one did not (a section that raised or was not started counts as one), 2 no CUDA
device or no triton, or a bad argument (nothing was run).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from engine import kernels
from engine.kernels import reference
from engine.kernels.batched import ancestor_matrix
from engine.models.common import Rotary
from engine.tools.arguments import positive_int, seconds
from engine.tools.batch_ties import MIN_EQUAL_SHARE, check_ties, tie_lines
from engine.tools.gpu_batched import check_batched, print_batched
from engine.tools.gpu_memory import LOAD_PEAK_LIMIT, check_memory, print_memory_report
from engine.tools.gpu_rounds import check_rounds, counted_compiles
from engine.tools.sections import Section, run_sections, write_json

# Qwen3.6-27B text config (config.json "text_config").
HIDDEN = 5120
INTERMEDIATE = 17408
ATTN_Q_HEADS, ATTN_KV_HEADS, ATTN_HEAD_DIM = 24, 4, 256
ROPE = Rotary(ATTN_HEAD_DIM, theta=1e7, partial_rotary_factor=0.25)  # 64 rotated dims
EPS = 1e-6
GDN_K_HEADS, GDN_V_HEADS, GDN_HEAD_DIM, CONV_KERNEL = 16, 48, 128, 4
GDN_KEY_DIM = GDN_K_HEADS * GDN_HEAD_DIM  # 2048
GDN_VALUE_DIM = GDN_V_HEADS * GDN_HEAD_DIM  # 6144
GDN_CONV_DIM = 2 * GDN_KEY_DIM + GDN_VALUE_DIM  # 10240: conv over [q ; k ; v]
VERIFY_TOKENS = 16  # DDTree budget 15 + the bonus root
GRAPHED_OVER_EAGER = 0.98  # steps as CUDA graphs must not be slower than eager
SECTIONS = ("correctness", "kernels", "stack", "recompiles", "memory", "rounds", "batched", "ties")
CONTEXTS = (64, 100, 128, 255, 512, 1000, 1024, 2047, 3000, 4096, 6000, 8192, 12345, 16384, 32768)

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float64: 1e-10}


# --- kernel inputs ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Sizes:
    """The kernel shapes of one layer: Gated DeltaNet heads, conv channels, attention heads,
    the hidden and MLP widths."""

    delta_heads: int
    delta_head_dim: int
    conv_channels: int
    q_heads: int
    kv_heads: int
    attn_head_dim: int
    hidden: int
    intermediate: int


QWEN36 = Sizes(
    GDN_V_HEADS, GDN_HEAD_DIM, GDN_CONV_DIM, ATTN_Q_HEADS, ATTN_KV_HEADS, ATTN_HEAD_DIM,
    HIDDEN, INTERMEDIATE,
)  # fmt: skip
SMALL = Sizes(4, 32, 64, 4, 2, 32, 96, 160)

_TRITON_MODULES = {
    "tree_gated_delta_rule": "engine.kernels.triton_gated_delta",
    "tree_causal_conv1d": "engine.kernels.triton_conv",
    "tree_attention": "engine.kernels.triton_attention",
    **dict.fromkeys(
        ("rms_norm", "add_rms_norm", "apply_rotary", "silu_mul"), "engine.kernels.triton_fused"
    ),
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
    visible = None if causal else ancestor_matrix(parents)
    attention = (
        randn(T, sizes.q_heads, Dh),
        randn(prefix + T, Hkv, Dh),
        randn(prefix + T, Hkv, Dh),
        prefix,
        visible,
        Dh**-0.5,
    )
    q, k, v = attention[:3]
    slack = torch.zeros(100, Hkv, Dh, device=device, dtype=dtype)  # a cache's unused slots
    length = torch.tensor([prefix], device=device)
    whole_cache = (q, torch.cat([k, slack]), torch.cat([v, slack]), length, *attention[4:])
    return {
        "gated_delta": ("tree_gated_delta_rule", delta),
        "gated_delta+states": ("tree_gated_delta_rule", (*delta, True)),
        "conv1d": ("tree_causal_conv1d", conv),
        "attention" + ("(causal)" if causal else ""): ("tree_attention", attention),
        "attention(whole cache)": ("tree_attention", whole_cache),
    }


def fused_calls(T: int, sizes: Sizes, dtype: torch.dtype, device) -> dict[str, tuple[str, tuple]]:
    """Random inputs for each fused layer kernel at one layer's widths: {label: (name, args)}."""

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device).to(dtype)

    hidden, heads = randn(T, sizes.hidden), randn(T, sizes.q_heads, 2 * sizes.attn_head_dim)
    queries = heads[..., : sizes.attn_head_dim]  # a strided view, as Qwen3.5's q beside its gate
    norm = (hidden, randn(sizes.hidden) * 0.1, EPS)
    cos, sin = Rotary(sizes.attn_head_dim, 1e7, 0.25).tables(torch.arange(T, device=device), dtype)
    return {
        "rms_norm": ("rms_norm", norm),
        "rms_norm(1+w)": ("rms_norm", (*norm, True)),
        "rms_norm(1+w) heads": ("rms_norm", (queries, norm[1][: sizes.attn_head_dim], EPS, True)),
        "add_rms_norm(1+w)": ("add_rms_norm", (hidden, randn(T, sizes.hidden), *norm[1:], True)),
        "rotary(partial)": ("apply_rotary", (queries, cos, sin)),
        "silu_mul": ("silu_mul", (randn(T, sizes.intermediate), randn(T, sizes.intermediate))),
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
            results += [_check_call(label, tree, dtype, *call) for label, call in calls.items()]
        fused = fused_calls(T, sizes, dtype, device)
        results += [_check_call(label, "-", dtype, *call) for label, call in fused.items()]
    return results


def _check_call(label: str, tree: str, dtype: torch.dtype, name: str, args: tuple) -> Comparison:
    triton_fn = getattr(importlib.import_module(_TRITON_MODULES[name]), name)
    try:
        return _compare(label, tree, dtype, triton_fn(*args), getattr(reference, name)(*args))
    except Exception as exc:  # the report names it, and the other checks still run
        return Comparison(label, tree, str(dtype).removeprefix("torch."), error=repr(exc))


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


def _norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Qwen3.5's RMSNorm, (1 + weight) * x / rms(x)."""
    return kernels.rms_norm(x, weight, EPS, zero_centered=True)


def _linear(in_features: int, out_features: int, device, dtype) -> torch.Tensor:
    return torch.randn(out_features, in_features, device=device, dtype=dtype) * in_features**-0.5


class _Mlp:
    def __init__(self, device, dtype):
        self.gate_up = _linear(HIDDEN, 2 * INTERMEDIATE, device, dtype)  # [2I, H]
        self.down = _linear(INTERMEDIATE, HIDDEN, device, dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [T, H]
        gate, up = (x @ self.gate_up.T).chunk(2, dim=-1)  # [T, I] each
        return kernels.silu_mul(gate, up) @ self.down.T


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
        self.zeros = torch.zeros(HIDDEN, device=device, dtype=dtype)  # norm weights (1 + 0)

    def __call__(self, x: torch.Tensor, tree: Tree) -> torch.Tensor:  # [T, H]
        T, parents = x.shape[0], tree.parents
        h = _norm(x, self.zeros)
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
        o = _norm(o, self.zeros[:GDN_HEAD_DIM]) * F.silu(z.view(T, GDN_V_HEADS, -1))
        return _residual_mlp(x, o.reshape(T, GDN_VALUE_DIM) @ self.out.T, self.zeros, self.mlp)


def _residual_mlp(x: torch.Tensor, mixed: torch.Tensor, weight: torch.Tensor, mlp: _Mlp):
    """x + mixed, then the post-mixer norm and MLP with their residual."""
    normed, x = kernels.add_rms_norm(x, mixed, weight, EPS, zero_centered=True)
    return x + mlp(normed)


@dataclass(frozen=True)
class Tree:
    """What a verify pass derives from `parents` once, before the layers run."""

    parents: torch.Tensor  # [T] int64
    visible: torch.Tensor  # [T, T] bool, ancestor mask
    cos: torch.Tensor  # [T, rotary dim] at positions prefix + depth
    sin: torch.Tensor
    prefix: int
    length: torch.Tensor | None  # [1] int64 = prefix on the device: attention reads the whole
    # cache and the pending K/V go in by index (a captured graph's way), else slices of it

    @classmethod
    def of(cls, parents: torch.Tensor, prefix: int, dtype, whole_cache: bool = False) -> Tree:
        visible = ancestor_matrix(parents)
        positions = prefix + visible.sum(dim=1) - 1  # ancestors of a node = its depth
        length = torch.tensor([prefix], device=parents.device) if whole_cache else None
        return cls(parents, visible, *ROPE.tables(positions, dtype), prefix, length)


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
        self.zeros = torch.zeros(HIDDEN, device=device, dtype=dtype)  # norm weights (1 + 0)

    def __call__(self, x: torch.Tensor, tree: Tree) -> torch.Tensor:  # [T, H]
        T = x.shape[0]
        q_dim, kv_dim = ATTN_Q_HEADS * ATTN_HEAD_DIM, ATTN_KV_HEADS * ATTN_HEAD_DIM
        h = _norm(x, self.zeros)
        q, gate, k, v = (h @ self.qkv.T).split([q_dim, q_dim, kv_dim, kv_dim], dim=-1)
        head_norm = self.zeros[:ATTN_HEAD_DIM]
        q = kernels.apply_rotary(_norm(q.view(T, ATTN_Q_HEADS, -1), head_norm), tree.cos, tree.sin)
        k = kernels.apply_rotary(_norm(k.view(T, ATTN_KV_HEADS, -1), head_norm), tree.cos, tree.sin)
        keys, values, prefix = self._write(tree, k, v.view(T, ATTN_KV_HEADS, -1))
        o = kernels.tree_attention(q, keys, values, prefix, tree.visible, ATTN_HEAD_DIM**-0.5)
        o = o.reshape(T, q_dim) * gate.sigmoid()
        return _residual_mlp(x, o @ self.out.T, self.zeros, self.mlp)

    def _write(self, tree: Tree, k: torch.Tensor, v: torch.Tensor):
        """The pending K/V into the cache; (keys, values, prefix) for the attention."""
        T = k.shape[0]
        if tree.length is None:
            end = tree.prefix + T
            self.k_cache[tree.prefix : end], self.v_cache[tree.prefix : end] = k, v
            return self.k_cache[:end], self.v_cache[:end], tree.prefix
        slots = tree.length + torch.arange(T, device=k.device)
        self.k_cache.index_copy_(0, slots, k)
        self.v_cache.index_copy_(0, slots, v)
        return self.k_cache, self.v_cache, tree.length


def build_stack(n_layers: int, device, dtype, max_len: int) -> list:
    """Every 4th layer full attention, the others Gated DeltaNet (as in Qwen3.6-27B)."""
    return [
        GatedAttentionLayer(device, dtype, max_len)
        if i % 4 == 3
        else GatedDeltaNetLayer(device, dtype)
        for i in range(n_layers)
    ]


def _forward(stack: list, parents: torch.Tensor, prefix: int, whole_cache: bool = False):
    """One pass of a random [T, hidden] input through the stack: verify (T = 16) or decode."""
    x = torch.randn(parents.shape[0], HIDDEN, device=parents.device, dtype=torch.bfloat16) * 0.1

    def forward() -> torch.Tensor:
        h, tree = x, Tree.of(parents, prefix, x.dtype, whole_cache)
        for layer in stack:
            h = layer(h, tree)
        return h

    return forward


def time_stack(device: torch.device, n_layers: int, prefix: int) -> dict[str, float]:
    """ms for one verify of a 16-token tree vs one decode step through the layer stack."""
    torch.manual_seed(0)
    stack = build_stack(n_layers, device, torch.bfloat16, prefix + VERIFY_TOKENS)
    tree, single = _trees(VERIFY_TOKENS, device)["random"], torch.tensor([-1], device=device)
    times = {}
    for backend in ("auto", "reference"):
        label = "triton" if backend == "auto" else "reference"
        with kernel_backend(backend), torch.inference_mode():
            times[f"{label}: verify 16-token tree"] = time_ms(_forward(stack, tree, prefix))
            times[f"{label}: decode step"] = time_ms(_forward(stack, single, prefix))
    return times


# --- 4. recompiles while the context grows -----------------------------------------------------


def check_recompiles(device: torch.device, contexts: tuple[int, ...] = CONTEXTS) -> dict:
    """Compiles while one attention + one Gated DeltaNet layer verify and decode at growing
    contexts, after the smallest and the largest ran once: {form: compiles}."""
    torch.manual_seed(0)
    dtype, max_len = torch.bfloat16, max(contexts) + VERIFY_TOKENS
    stack = [GatedDeltaNetLayer(device, dtype), GatedAttentionLayer(device, dtype, max_len)]
    passes = (_trees(VERIFY_TOKENS, device)["random"], torch.tensor([-1], device=device))
    report = {}
    for form, whole_cache in (("growing slice", False), ("whole cache", True)):

        def run(prefix: int, whole_cache: bool = whole_cache) -> None:
            for parents in passes:
                _forward(stack, parents, prefix, whole_cache)()

        with torch.inference_mode():
            run(contexts[0]), run(contexts[-1])
            with counted_compiles() as compiled:
                for prefix in contexts[1:-1]:
                    run(prefix)
        report[form] = len(compiled)
    return report


# --- report -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Figure:
    """One figure of the report beside its target."""

    name: str
    value: float | int | str
    target: str
    passed: bool
    unit: str = ""


def figures(report: dict) -> list[Figure]:
    """Every figure of the report's sections with its target (the issue's, or the check's own
    limit); a section that raised or was not started is a failed figure of its own."""
    out = []
    if (rows := report.get("correctness")) is not None:
        failed = sum(not row["passed"] for row in rows)
        out.append(
            Figure("kernels vs references (failed)", failed, f"0 of {len(rows)}", not failed)
        )
    if stack := report.get("stack"):
        ratio = stack["triton: verify 16-token tree"] / stack["triton: decode step"]
        out.append(
            Figure("layer stack verify(16) / decode", round(ratio, 3), "<= 1.15", ratio <= 1.15)
        )
    if (counts := report.get("recompiles")) is not None:
        recompiles = sum(counts.values())
        out.append(Figure("recompiles while the context grows", recompiles, "0", not recompiles))
    if memory := report.get("memory"):
        load = memory["load_peak_ratio"]
        within = memory["prefill_peak_bytes"] <= memory["plan_total_bytes"]
        share = round(memory["prefill_peak_bytes"] / memory["plan_total_bytes"], 3)
        out += [
            Figure("load peak / weights", load, f"<= {LOAD_PEAK_LIMIT}", load <= LOAD_PEAK_LIMIT),
            Figure("prefill peak / plan", share, "<= 1", within),
        ]
    for row in report.get("rounds") or ():  # gpu_rounds' figures: a limit, or None for none
        target = "-" if row["limit"] is None else f"<= {row['limit']:g}"
        value, unit = round(row["value"], 3), row["unit"].strip()
        out.append(Figure(row["name"], value, target, bool(row["passed"]), unit))
    if batched := report.get("batched"):
        out += batched_figures(batched)
    if ties := report.get("ties"):
        beyond = sum(not item["near_tie"] for item in ties["divergences"])
        share = round(ties["least_equal_share"], 3)
        target, enough = f">= {MIN_EQUAL_SHARE}", share >= MIN_EQUAL_SHARE
        out += [
            Figure("batched vs alone at bf16: flips beyond a near-tie", beyond, "0", not beyond),
            Figure("batched vs alone at bf16: least share equal", share, target, enough),
        ]
    for name, error in report.get("errors", {}).items():
        out.append(Figure(f"section {name}", f"raised {error}", "completes", False))
    for name in report.get("skipped", []):
        out.append(Figure(f"section {name}", "not started (deadline)", "completes", False))
    return out


def batched_figures(batched: dict) -> list[Figure]:
    """Each method's aggregate tok/s at its highest concurrency over its own at the lowest, as
    measured on the deeper stack: what batching gives (no target: issue 36 sets none here)."""
    layers = 2 * batched["layers"]
    by_method: dict[str, dict[int, float]] = {}
    for row in batched["rows"]:
        by_method.setdefault(row["method"], {})[row["concurrency"]] = row[f"tokens_per_s_{layers}"]
    out = []
    for method, rates in by_method.items():
        low, high = min(rates), max(rates)
        if low != high and rates[low] > 0:
            ratio = round(rates[high] / rates[low], 2)
            name = f"batched {method}: tok/s at {high} / at {low} ({layers} layers)"
            out.append(Figure(name, ratio, "-", True, "x"))
    for method in [method for method in by_method if f"{method} eager" in by_method]:
        graphed, eager = by_method[method], by_method[f"{method} eager"]
        high = max(eager)  # its steps' graphs (step_passes.py, tree_passes.py)
        if eager[high] > 0 and high in graphed:
            ratio = round(graphed[high] / eager[high], 2)
            name = f"batched {method}: steps graphed / eager at {high} ({layers} layers)"
            passed = ratio >= GRAPHED_OVER_EAGER
            out.append(Figure(name, ratio, f">= {GRAPHED_OVER_EAGER}", passed, "x"))
    return out


def _no_device_reason() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    return None


def _print_report(report: dict) -> None:
    print(f"device: {report['device']}")
    for row in report.get("correctness", ()):
        verdict = "ok  " if row["passed"] else "FAIL"
        detail = row["error"] or f"max|diff| {row['max_abs_diff']:.3g}"
        print(f"  {verdict} {row['kernel']:<22} {row['tree']:<10} {row['dtype']:<9} {detail}")
    if "kernels" in report:
        print(f"kernel ms (bf16, random tree, attention prefix {report['prefix']}):")
        for name, cols in report["kernels"].items():
            print(f"  {name:<26} " + "  ".join(f"{k} {v:.4f}" for k, v in cols.items()))
    if "stack" in report:
        print(f"layer stack ms ({report['layers']} layers, prefix {report['prefix']}, bf16):")
        for name, ms in report["stack"].items():
            print(f"  {name:<36} {ms:.3f}")
    if "recompiles" in report:
        print(f"compiles while the context grows {CONTEXTS[1]} .. {CONTEXTS[-2]}:")
        for form, compiles in report["recompiles"].items():
            print(f"  {form:<14} {compiles}")
    if "memory" in report:
        print_memory_report(report["memory"])
    if "batched" in report:
        print_batched(report["batched"])
    if "ties" in report:
        print("\n".join(tie_lines(report["ties"], "bfloat16 (the demo pair)")))
    print(f"figures ({report['seconds']} s):")
    for fig in report["figures"]:
        value = f"{fig['value']} {fig['unit']}".strip()
        verdict = "ok" if fig["passed"] else "FAIL"
        print(f"  {verdict:<4} {fig['name']:<44} {value:>14}   target {fig['target']}")


def sections(device: torch.device, args: argparse.Namespace) -> list[Section]:
    """The run's sections in SECTIONS' order, less those --only and --skip leave out."""
    runs = {
        "correctness": lambda: [vars(c) for c in check_correctness(device, args.prefix)],
        "kernels": lambda: time_kernels(device, args.prefix),
        "stack": lambda: time_stack(device, args.layers, args.prefix),
        "recompiles": lambda: check_recompiles(device),
        "memory": lambda: check_memory(device, args.memory_layers, args.memory_prompt),
        "rounds": lambda: check_rounds(device, layers=args.rounds_layers),
        "batched": lambda: check_batched(
            device, layers=args.batched_layers, prefix=args.batched_prefix
        ),
        "ties": lambda: check_ties(device.type),
    }
    chosen = args.only or [name for name in SECTIONS if name not in (args.skip or ())]
    return [Section(name, runs[name]) for name in SECTIONS if name in chosen]


def section_names(text: str) -> list[str]:
    """--only's and --skip's comma-separated section names, each one of SECTIONS."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in SECTIONS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected section names among {', '.join(SECTIONS)}"
        )
    return names


def out_path(text: str) -> Path:
    """--out: a file in a directory that exists (checked before the device work, not after)."""
    path = Path(text)
    if not path.parent.is_dir() or path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: not a file in an existing directory")
    return path


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=out_path, help="the report as JSON, after each section")
    choice = parser.add_mutually_exclusive_group()
    choice.add_argument("--only", type=section_names, help="run these sections alone (comma list)")
    choice.add_argument("--skip", type=section_names, help="leave these sections out (comma list)")
    parser.add_argument("--deadline", type=seconds, help="start no section after these seconds")
    parser.add_argument("--layers", type=positive_int, default=4, help="layers in the timed stack")
    parser.add_argument("--prefix", type=positive_int, default=4096, help="tokens before the tree")
    parser.add_argument(
        "--memory-layers", type=positive_int, default=4, help="the loaded checkpoint's"
    )
    parser.add_argument("--memory-prompt", type=positive_int, default=32768, help="prefill tokens")
    parser.add_argument("--rounds-layers", type=positive_int, default=4, help="the rounds' stack")
    parser.add_argument("--batched-layers", type=positive_int, default=4, help="the batched stack")
    parser.add_argument("--batched-prefix", type=positive_int, default=4096, help="each prompt's")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if reason := _no_device_reason():
        print(f"gpu_check: {reason}: nothing to check", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    started = time.monotonic()
    report = {
        "device": torch.cuda.get_device_name(device),
        "layers": args.layers,
        "prefix": args.prefix,
    }

    def save(report: dict) -> None:
        report["seconds"] = round(time.monotonic() - started, 1)
        report["figures"] = [vars(f) for f in figures(report)]
        if args.out:
            write_json(args.out, report)

    run_sections(sections(device, args), report, save, args.deadline)
    save(report)
    _print_report(report)
    return 0 if all(f["passed"] for f in report["figures"]) else 1


if __name__ == "__main__":
    sys.exit(main())
