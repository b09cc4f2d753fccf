"""Triton kernel: attention of T tree queries over [committed prefix ; tree] (GQA, online softmax).

Matches `engine.kernels.reference.tree_attention` (the specification). Layout of the work:

- Query rows are packed per key/value head: the T * G query heads that read one kv head
  (G = Hq // Hkv) form the rows of one tile, so each K/V block is loaded once for all of them.
  Row r is token r // G, query head kv_head * G + r % G.
- Keys are split into NUM_SPLITS contiguous ranges (flash-decoding): with few queries, one
  program per (row block, kv head) would leave most of a GPU idle on a long prefix. Each split
  keeps a running max / sum (online softmax) and writes its normalised output with its
  log-sum-exp; `_merge_splits` combines them. With one split the kernel writes the output.
- A key j < prefix_len is visible to every row; a tree key is visible when tree_visible[t,
  j - prefix_len] (or, with no tree given, when j - prefix_len <= t: causal).

Precision follows the reference: softmax and accumulation in float32 (float64 for float64
inputs). The dots take bf16/fp16 inputs as they are, and float32 inputs without TF32
("ieee"). Under the interpreter every dot runs in the compute type: bf16 `tl.dot` is wrong there.

Run on CPU with TRITON_INTERPRET=1 set before this module is imported (tests do).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.kernels.reference import compute_dtype
from engine.kernels.triton_common import tl_compute_dtype, tl_dot_dtype

# A finite "minus infinity" for the running max: keeps exp(m_old - m_new) free of NaN on rows
# that have seen no visible key yet.
_NO_SCORE: tl.constexpr = tl.constexpr(-1.0e30)


@triton.jit(do_not_specialize=["T", "S", "prefix_len", "keys_per_split"])
def _tree_attention_kernel(
    q_ptr,  # [T, Hq, D], strides (q_stride_t, q_stride_h, 1)
    k_ptr,  # [S, Hkv, D], strides (k_stride_s, k_stride_h, 1)
    v_ptr,  # [S, Hkv, D], strides (v_stride_s, v_stride_h, 1)
    visible_ptr,  # [T, T] int8 (unused when CAUSAL)
    out_ptr,  # [T, Hq, D] (one split) or [NUM_SPLITS, T, Hq, D] in COMPUTE, contiguous
    lse_ptr,  # [NUM_SPLITS, T, Hq] in COMPUTE (unused with one split)
    q_stride_t,
    q_stride_h,
    k_stride_s,
    k_stride_h,
    v_stride_s,
    v_stride_h,
    T,
    Hkv,
    S,
    prefix_len,
    keys_per_split,
    scale,
    D: tl.constexpr,
    GROUP: tl.constexpr,
    CAUSAL: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    COMPUTE: tl.constexpr,  # softmax / accumulator type
    DOT: tl.constexpr,  # operand type of the dots
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    token = (rows // GROUP).to(tl.int64)  # [BM]; int64: offsets of a long prefill pass 2^31
    head = kv_head * GROUP + rows % GROUP  # [BM]
    row_ok = token < T
    dims = tl.arange(0, BLOCK_D)  # [BD]
    dim_ok = dims < D
    Hq = Hkv * GROUP
    q_rows = token * q_stride_t + head * q_stride_h  # [BM]
    q_mask = row_ok[:, None] & dim_ok[None, :]
    q = tl.load(q_ptr + q_rows[:, None] + dims[None, :], mask=q_mask, other=0.0).to(DOT)
    out_rows = (token * Hq + head) * D  # [BM]

    m = tl.full([BLOCK_M], _NO_SCORE, COMPUTE)  # running max of the scores
    l = tl.zeros([BLOCK_M], COMPUTE)  # running sum of exp(score - m)
    acc = tl.zeros([BLOCK_M, BLOCK_D], COMPUTE)  # running sum of exp(score - m) * v
    start = split * keys_per_split
    end = tl.minimum(start + keys_per_split, S)
    for block_start in range(start, end, BLOCK_N):
        keys = block_start + tl.arange(0, BLOCK_N)  # [BN]
        key_ok = keys < end
        key_pos = keys.to(tl.int64)  # [BN]; a long cache overflows int32 offsets
        k_off = key_pos * k_stride_s + kv_head * k_stride_h  # [BN]
        v_off = key_pos * v_stride_s + kv_head * v_stride_h  # [BN]
        kv_mask = key_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_ptr + k_off[:, None] + dims[None, :], mask=kv_mask, other=0.0).to(DOT)
        v = tl.load(v_ptr + v_off[:, None] + dims[None, :], mask=kv_mask, other=0.0).to(DOT)
        scores = tl.dot(q, tl.trans(k), input_precision="ieee").to(COMPUTE) * scale  # [BM, BN]

        tree_col = keys - prefix_len  # [BN], < 0 for prefix keys
        in_tree = tree_col >= 0
        if CAUSAL:
            sees_tree = tree_col[None, :] <= token[:, None]
        else:
            tree_mask = row_ok[:, None] & (in_tree & key_ok)[None, :]
            tree_ptrs = visible_ptr + token[:, None] * T + tree_col[None, :]
            sees_tree = tl.load(tree_ptrs, mask=tree_mask, other=0) != 0
        visible = key_ok[None, :] & (~in_tree[None, :] | sees_tree)  # [BM, BN]
        scores = tl.where(visible, scores, float("-inf"))

        m_new = tl.maximum(m, tl.max(scores, axis=1))
        p = tl.exp(scores - m_new[:, None])  # [BM, BN]
        rescale = tl.exp(m - m_new)
        l = l * rescale + tl.sum(p, axis=1)
        pv = tl.dot(p.to(DOT), v, input_precision="ieee").to(COMPUTE)
        acc = acc * rescale[:, None] + pv
        m = m_new

    has_keys = l > 0
    safe_l = tl.where(has_keys, l, 1.0)
    out = acc / safe_l[:, None]
    out_mask = row_ok[:, None] & dim_ok[None, :]
    if NUM_SPLITS == 1:
        out_ptrs = out_ptr + out_rows[:, None] + dims[None, :]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        split_rows = split.to(tl.int64) * T * Hq * D + out_rows  # [BM]
        tl.store(out_ptr + split_rows[:, None] + dims[None, :], out, mask=out_mask)
        lse = tl.where(has_keys, m + tl.log(safe_l), _NO_SCORE)  # [BM]
        tl.store(lse_ptr + split.to(tl.int64) * T * Hq + token * Hq + head, lse, mask=row_ok)


@dataclass(frozen=True)
class _Launch:
    block_m: int
    block_n: int
    block_d: int
    num_splits: int
    keys_per_split: int
    num_warps: int


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _default_num_splits(row_blocks: int, Hkv: int, S: int, block_n: int, device) -> int:
    """Enough key splits to give every SM about two programs, at least 4 key blocks each."""
    if device.type != "cuda":
        return 1
    sms = _multiprocessors(device)
    wanted = triton.cdiv(2 * sms, row_blocks * Hkv)
    return max(1, min(wanted, triton.cdiv(S, 4 * block_n)))


def _launch_config(
    rows: int, Hkv: int, S: int, D: int, device, num_splits: int | None, block_n: int | None
) -> _Launch:
    block_d = max(16, triton.next_power_of_2(D))
    block_m = 16 if rows <= 16 else (32 if rows <= 32 else 64)
    block_n = block_n or (64 if block_d <= 128 else 32)
    row_blocks = triton.cdiv(rows, block_m)
    splits = num_splits or _default_num_splits(row_blocks, Hkv, S, block_n, device)
    keys_per_split = triton.cdiv(triton.cdiv(S, splits), block_n) * block_n
    splits = triton.cdiv(S, keys_per_split)  # no empty trailing split
    num_warps = 8 if block_d > 128 else 4
    return _Launch(block_m, block_n, block_d, splits, keys_per_split, num_warps)


def _merge_splits(
    partial: torch.Tensor,  # [NS, T, Hq, D], each split normalised on its own
    lse: torch.Tensor,  # [NS, T, Hq], log of each split's softmax denominator
) -> torch.Tensor:  # [T, Hq, D]
    weights = torch.softmax(lse, dim=0)  # [NS, T, Hq]
    return (weights[..., None] * partial).sum(dim=0)


def tree_attention(
    q: torch.Tensor,  # [T, Hq, D] (RoPE applied)
    k: torch.Tensor,  # [S, Hkv, D], S = prefix_len + T
    v: torch.Tensor,  # [S, Hkv, D]
    prefix_len: int,
    tree_visible: torch.Tensor | None,  # [T, T] bool, None = causal
    scale: float,
    *,
    num_splits: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:  # [T, Hq, D] in q's dtype
    """Triton version of `reference.tree_attention`: same arguments, same result.

    `num_splits` (key ranges processed in parallel) and `block_n` (keys per step) override the
    launch heuristics; results do not depend on them beyond rounding.
    """
    T, Hq, D = q.shape
    S, Hkv, _ = k.shape
    if S != prefix_len + T:
        raise ValueError(f"{S} keys for a prefix of {prefix_len} and {T} queries")
    if Hq % Hkv:
        raise ValueError(f"{Hq} query heads do not share {Hkv} kv heads evenly")
    out = torch.empty_like(q)
    if T == 0:
        return out
    compute = compute_dtype(q.dtype)
    if compute == torch.float64:
        # A float argument reaches a kernel as float32: fold the scale in exactly instead.
        q, scale = q * scale, 1.0
    # Any layout whose head dim is dense (a slice of a preallocated cache) is read in place.
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    group = Hq // Hkv
    cfg = _launch_config(T * group, Hkv, S, D, q.device, num_splits, block_n)
    causal = tree_visible is None
    visible = q if causal else tree_visible.to(device=q.device, dtype=torch.int8).contiguous()
    if cfg.num_splits == 1:
        target, lse = out, out
    else:
        target = torch.empty(cfg.num_splits, T, Hq, D, dtype=compute, device=q.device)
        lse = torch.empty(cfg.num_splits, T, Hq, dtype=compute, device=q.device)
    grid = (triton.cdiv(T * group, cfg.block_m), Hkv, cfg.num_splits)
    _tree_attention_kernel[grid](
        q, k, v, visible, target, lse,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        T, Hkv, S, prefix_len, cfg.keys_per_split, float(scale),
        D=D, GROUP=group, CAUSAL=causal, NUM_SPLITS=cfg.num_splits,
        COMPUTE=tl_compute_dtype(q.dtype),
        DOT=tl_dot_dtype(q.dtype),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=cfg.block_d,
        num_warps=cfg.num_warps,
    )  # fmt: skip
    if cfg.num_splits == 1:
        return out
    return _merge_splits(target, lse).to(q.dtype)
