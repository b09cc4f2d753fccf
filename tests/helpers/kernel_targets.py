"""Compile the Triton kernels for Hopper (sm_90) and Blackwell (sm_120) at Qwen3.6-27B shapes,
without a GPU (triton.compile builds the cubin with the ptxas its wheel bundles), and report the
shared memory each uses per block. tests/engine/test_kernel_targets.py runs this in a fresh
process: with Triton 3.9, a process is either the interpreter's or the compiler's, whichever
imported triton first (triton.language's own jit helpers are defined for that mode only, and the
interpreter leaves some of triton.language patched), and the kernel tests' process is the
interpreter's.

    python -m tests.helpers.kernel_targets CASE...   # prints {case: shared bytes} as JSON
"""

from __future__ import annotations

import json
import sys

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from tests.helpers.kernel_cases import compiled_copy

Q_HEADS, KV_HEADS, HEAD_DIM, HIDDEN, ROTARY_DIM = 24, 4, 256, 5120, 64  # Qwen3.6-27B
GDN_HEAD_DIM, CONV_KERNEL = 128, 4
# rows, device prefix, paged (block tables and per-sequence lengths)
ATTENTION_SHAPES = {
    "verify-graph": (96, True, False),
    "decode": (6, False, False),
    "paged-verify": (96, True, True),
}


def _compile(kernel, types: dict[str, str], constexprs: dict, capability: int, **options) -> int:
    """Compile `kernel` for sm_<capability>; the shared memory (bytes) it uses per block.
    Arguments not in `types` or `constexprs` are 32-bit ints."""
    signature = {
        name: "constexpr" if name in constexprs else types.get(name, "i32")
        for name in kernel.arg_names
    }
    target = GPUTarget("cuda", capability, 32)
    compiled = triton.compile(ASTSource(kernel, signature, constexprs), target, options)
    return compiled.metadata.shared


def attention_shared(capability: int, shape: str) -> int:
    """A verify (16 tokens x 6 query heads a kv head) reading the length on the device, as a
    captured graph does, a decode step (6 rows) with a host length, or a verify over block
    tables (paged KV, several sequences a launch)."""
    attention = compiled_copy("engine.kernels.triton_attention")
    rows, device_prefix, paged = ATTENTION_SHAPES[shape]
    cfg = attention.attention_config(divmod(capability, 10), HEAD_DIM, rows)
    types = dict.fromkeys(("q_ptr", "k_ptr", "v_ptr", "out_ptr"), "*bf16")
    types |= {"visible_ptr": "*i8", "partial_ptr": "*fp32", "lse_ptr": "*fp32", "scale": "fp32"}
    types["prefix"] = "*i64" if device_prefix else "i32"
    types |= dict.fromkeys(("table_ptr", "starts_ptr"), "*i64" if paged else "*bf16")
    constexprs = dict(
        D=HEAD_DIM, GROUP=Q_HEADS // KV_HEADS, CAUSAL=False, PREFIX_ON_DEVICE=device_prefix,
        PAGED=paged,
        COMPUTE=tl.float32, DOT=tl.bfloat16, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_D=HEAD_DIM,
    )  # fmt: skip
    options = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    return _compile(attention._tree_attention_kernel, types, constexprs, capability, **options)


def recurrent_shared(capability: int) -> int:
    """The Gated DeltaNet and conv kernels at Qwen3.6-27B's 128 x 128 heads, bf16 inputs: the
    larger of the two."""
    gated_delta = compiled_copy("engine.kernels.triton_gated_delta")
    conv = compiled_copy("engine.kernels.triton_conv")
    delta_types = {name: "*fp32" for name in gated_delta._tree_gated_delta_kernel.arg_names}
    delta_types |= {"k_ptr": "*bf16", "v_ptr": "*bf16", "out_ptr": "*bf16"}
    delta_types |= {"parents_ptr": "*i64", "slots_ptr": "*i64"}
    for name in ("T", "H", "Dk", "Dv"):
        del delta_types[name]
    delta = dict(COMPUTE=tl.float32, BLOCK_K=GDN_HEAD_DIM, BLOCK_V=4096 // GDN_HEAD_DIM)
    conv_types = dict.fromkeys(("x_ptr", "state_ptr", "weight_ptr", "bias_ptr", "out_ptr"), "*bf16")
    conv_types["parents_ptr"] = "*i64"
    convolution = dict(K=CONV_KERNEL, COMPUTE=tl.float32, HAS_BIAS=False, SILU=True, BLOCK_C=256)
    return max(
        _compile(kernel, types, constexprs, capability, num_warps=4)
        for kernel, types, constexprs in [
            (gated_delta._tree_gated_delta_kernel, delta_types, delta),
            (conv._tree_conv_kernel, conv_types, convolution),
        ]
    )


def fused_shared(capability: int) -> int:
    """The split-merge, RMSNorm, RoPE and SiLU-multiply kernels: the largest of them."""
    attention = compiled_copy("engine.kernels.triton_attention")
    fused = compiled_copy("engine.kernels.triton_fused")
    bf16 = "*bf16"
    merge_types = {"partial_ptr": "*fp32", "lse_ptr": "*fp32", "out_ptr": bf16}
    merge = dict(D=HEAD_DIM, COMPUTE=tl.float32, BLOCK_D=HEAD_DIM)
    norm_types = dict.fromkeys(("x_ptr", "delta_ptr", "sum_ptr", "weight_ptr", "out_ptr"), bf16)
    norm = dict(HAS_DELTA=True, ZERO_CENTERED=True, COMPUTE=tl.float32, BLOCK_N=8192)
    rope_types = dict.fromkeys(("x_ptr", "cos_ptr", "sin_ptr", "out_ptr"), bf16)
    rope = dict(
        D=HEAD_DIM, HALF=ROTARY_DIM // 2, COMPUTE=tl.float32, BLOCK_H=16,
        BLOCK_HALF=ROTARY_DIM // 2, BLOCK_REST=HEAD_DIM,
    )  # fmt: skip
    silu_types = dict.fromkeys(("gate_ptr", "up_ptr", "out_ptr"), bf16)
    silu = dict(COMPUTE=tl.float32, BLOCK=1024)
    norm_types["eps"] = "fp32"
    return max(
        _compile(kernel, types, constexprs, capability, num_warps=warps)
        for kernel, types, constexprs, warps in [
            (attention._merge_splits_kernel, merge_types, merge, 4),
            (fused._rms_norm_kernel, norm_types, norm, fused._warps(HIDDEN)),
            (fused._rotary_kernel, rope_types, rope, fused._warps(16 * HEAD_DIM)),
            (fused._silu_mul_kernel, silu_types, silu, fused._warps(1024)),
        ]
    )


def shared_bytes(case: str) -> int:
    """A case is `attention-<shape>-<capability>`, `recurrent-<capability>` or `fused-<capability>`."""
    kind, *rest = case.split("-")
    capability = int(rest[-1])
    if kind == "attention":
        return attention_shared(capability, "-".join(rest[:-1]))
    return {"recurrent": recurrent_shared, "fused": fused_shared}[kind](capability)


if __name__ == "__main__":
    print(json.dumps({case: shared_bytes(case) for case in sys.argv[1:]}))
