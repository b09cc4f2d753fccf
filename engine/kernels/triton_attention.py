"""Triton kernel: attention of T tree queries over [committed prefix ; tree] (GQA, online softmax).

Matches `engine.kernels.reference.tree_attention` (the specification). Layout of the work:

- Query rows are packed per key/value head: the T * G query heads that read one kv head
  (G = Hq // Hkv) form the rows of one tile, so each K/V block is loaded once for all of them.
  Row r is token r // G, query head kv_head * G + r % G.
- Keys are split into `num_splits` contiguous ranges (flash-decoding): with few queries, one
  program per (row block, kv head) would leave most of a GPU idle on a long prefix. Each split
  keeps a running max / sum (online softmax) and writes its normalised output with its
  log-sum-exp; `_merge_splits_kernel` combines them. With one split the kernel writes the output.
- The split count and every length are runtime arguments, never specialised on: a conversation
  that grows reuses one compiled kernel, and a captured CUDA graph stays valid when the prefix
  length is a device tensor (the kernel reads it and sizes each split itself). The split count
  follows the key buffer's length, which is fixed for a preallocated cache.
- A key j < prefix_len is visible to every row; a tree key is visible when tree_visible[t,
  j - prefix_len] (or, with no tree given, when j - prefix_len <= t: causal); keys from
  prefix_len + T on are ignored (the unused end of a preallocated cache).

Launch configurations come from `attention_config` by compute capability and head dim: head dim
256 (Qwen3.6-27B) needs smaller key blocks where shared memory is ~100 KB (sm_86/89, sm_120)
than on Hopper / datacenter parts (sm_80, sm_90, sm_100: ~230 KB).

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
# that have seen no visible key yet, and marks an empty split for the merge.
_NO_SCORE: tl.constexpr = tl.constexpr(-1.0e30)

# Arguments that change as a conversation grows: specialising on any of them (Triton does on
# values of 1 and multiples of 16 by default) would compile a kernel per new value.
RUNTIME_ARGS = ["T", "prefix", "keys", "num_splits", "rows_total", "visible_stride"]


@triton.jit(do_not_specialize=RUNTIME_ARGS)
def _tree_attention_kernel(
    q_ptr,  # [rows_total, Hq, D], strides (q_stride_t, q_stride_h, 1)
    k_ptr,  # [keys, Hkv, D], strides (k_stride_s, k_stride_h, 1); keys >= prefix_len + T;
    #   PAGED: [blocks, block_tokens, Hkv, D], strides (k_stride_b, k_stride_s, k_stride_h, 1)
    v_ptr,  # as k_ptr, with the v strides
    visible_ptr,  # [rows_total, visible_stride] int8 (unused when CAUSAL)
    out_ptr,  # [rows_total, Hq, D] in q's dtype: written when num_splits == 1
    partial_ptr,  # [num_splits, rows_total, Hq, D] in COMPUTE: written when num_splits > 1
    lse_ptr,  # [num_splits, rows_total, Hq] in COMPUTE: written when num_splits > 1
    prefix,  # prefix_len: an int, or a pointer to one (int64) when PREFIX_ON_DEVICE;
    #   PAGED: a pointer to each sequence's (int64)
    table_ptr,  # PAGED: [B, table_stride] int64 block tables (unused otherwise)
    starts_ptr,  # PAGED: [B + 1] int64 each sequence's first query row (unused otherwise)
    q_stride_t,
    q_stride_h,
    k_stride_b,
    k_stride_s,
    k_stride_h,
    v_stride_b,
    v_stride_s,
    v_stride_h,
    table_stride,
    block_tokens,
    visible_stride,
    T,  # queries (PAGED: the most of any sequence)
    rows_total,  # query rows of the whole launch
    Hkv,
    keys,  # key slots (PAGED: of a whole block table)
    num_splits,
    scale,
    D: tl.constexpr,
    GROUP: tl.constexpr,
    CAUSAL: tl.constexpr,
    PREFIX_ON_DEVICE: tl.constexpr,
    PAGED: tl.constexpr,  # several sequences, each over its block table
    COMPUTE: tl.constexpr,  # softmax / accumulator type
    DOT: tl.constexpr,  # operand type of the dots
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    kv_head = tl.program_id(1)
    seq = tl.program_id(2) // num_splits
    split = tl.program_id(2) % num_splits
    if PAGED:
        first_row = tl.load(starts_ptr + seq)
        queries = (tl.load(starts_ptr + seq + 1) - first_row).to(tl.int32)
        prefix_len = tl.load(prefix + seq).to(tl.int32)
    else:
        first_row = 0
        queries = T
        prefix_len = tl.load(prefix).to(tl.int32) if PREFIX_ON_DEVICE else prefix
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    token = (rows // GROUP).to(tl.int64)  # [BM]; int64: offsets of a long prefill pass 2^31
    head = kv_head * GROUP + rows % GROUP  # [BM]
    row_ok = token < queries
    row = first_row + token  # [BM] the query's row in the launch
    dims = tl.arange(0, BLOCK_D)  # [BD]
    dim_ok = dims < D
    Hq = Hkv * GROUP
    q_rows = row * q_stride_t + head * q_stride_h  # [BM]
    q_mask = row_ok[:, None] & dim_ok[None, :]
    q = tl.load(q_ptr + q_rows[:, None] + dims[None, :], mask=q_mask, other=0.0).to(DOT)
    out_rows = (row * Hq + head) * D  # [BM]

    m = tl.full([BLOCK_M], _NO_SCORE, COMPUTE)  # running max of the scores
    l = tl.zeros([BLOCK_M], COMPUTE)  # running sum of exp(score - m)
    acc = tl.zeros([BLOCK_M, BLOCK_D], COMPUTE)  # running sum of exp(score - m) * v
    S = tl.minimum(prefix_len + queries, keys)
    S = tl.where(tl.program_id(0) * BLOCK_M < queries * GROUP, S, 0)  # rows past the sequence's
    keys_per_split = tl.cdiv(tl.cdiv(S, num_splits), BLOCK_N) * BLOCK_N
    start = split * keys_per_split
    end = tl.minimum(start + keys_per_split, S)
    for block_start in range(start, end, BLOCK_N):
        cols = block_start + tl.arange(0, BLOCK_N)  # [BN]
        key_ok = cols < end
        key_pos = cols.to(tl.int64)  # [BN]; a long cache overflows int32 offsets
        if PAGED:
            table = table_ptr + seq.to(tl.int64) * table_stride
            block = tl.load(table + key_pos // block_tokens, mask=key_ok, other=0)  # [BN]
            k_off = block * k_stride_b + (key_pos % block_tokens) * k_stride_s
            v_off = block * v_stride_b + (key_pos % block_tokens) * v_stride_s
        else:
            k_off = key_pos * k_stride_s
            v_off = key_pos * v_stride_s
        k_off += kv_head * k_stride_h  # [BN]
        v_off += kv_head * v_stride_h
        kv_mask = key_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_ptr + k_off[:, None] + dims[None, :], mask=kv_mask, other=0.0).to(DOT)
        v = tl.load(v_ptr + v_off[:, None] + dims[None, :], mask=kv_mask, other=0.0).to(DOT)
        scores = tl.dot(q, tl.trans(k), input_precision="ieee").to(COMPUTE) * scale  # [BM, BN]

        tree_col = cols - prefix_len  # [BN], < 0 for prefix keys
        in_tree = tree_col >= 0
        if CAUSAL:
            sees_tree = tree_col[None, :] <= token[:, None]
        else:
            tree_mask = row_ok[:, None] & (in_tree & key_ok)[None, :]
            tree_ptrs = visible_ptr + row[:, None] * visible_stride + tree_col[None, :]
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
    if num_splits == 1:
        out_ptrs = out_ptr + out_rows[:, None] + dims[None, :]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        split_rows = split.to(tl.int64) * rows_total * Hq * D + out_rows  # [BM]
        tl.store(partial_ptr + split_rows[:, None] + dims[None, :], out, mask=out_mask)
        lse = tl.where(has_keys, m + tl.log(safe_l), _NO_SCORE)  # [BM]
        lse_rows = split.to(tl.int64) * rows_total * Hq + row * Hq + head
        tl.store(lse_ptr + lse_rows, lse, mask=row_ok)


@triton.jit(do_not_specialize=["rows", "num_splits"])
def _merge_splits_kernel(
    partial_ptr,  # [num_splits, rows, D] in COMPUTE, each split normalised on its own
    lse_ptr,  # [num_splits, rows] in COMPUTE: log of each split's softmax denominator
    out_ptr,  # [rows, D] (rows = T * Hq)
    rows,
    num_splits,
    D: tl.constexpr,
    COMPUTE: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < D
    top = tl.full([], _NO_SCORE, COMPUTE)
    for split in range(num_splits):
        top = tl.maximum(top, tl.load(lse_ptr + split * rows + row))
    total = tl.zeros([], COMPUTE)
    acc = tl.zeros([BLOCK_D], COMPUTE)
    for split in range(num_splits):
        weight = tl.exp(tl.load(lse_ptr + split * rows + row) - top)  # 0 for an empty split
        part = tl.load(partial_ptr + (split * rows + row) * D + dims, mask=dim_ok, other=0.0)
        acc += weight * part
        total += weight
    tl.store(out_ptr + row * D + dims, (acc / total).to(out_ptr.dtype.element_ty), mask=dim_ok)


@dataclass(frozen=True)
class AttentionConfig:
    """Compile-time launch choices: they follow the model and the GPU, never the context."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# Compute capabilities with ~230 KB of shared memory a block (A100, H100/H200, B200); the others
# (RTX 30/40, RTX PRO 6000 Blackwell sm_120) have ~100 KB.
_LARGE_SHARED_MEMORY = {(8, 0), (9, 0), (10, 0), (10, 3)}


def attention_config(
    capability: tuple[int, int] | None, head_dim: int, rows: int
) -> AttentionConfig:
    """The launch configuration for `rows` query rows (T * group) of `head_dim` on a GPU of
    `capability` (None: unknown, e.g. the CPU interpreter: the small-memory choice).

    Shared memory holds the query tile and `num_stages` K/V tiles of BLOCK_N keys. At head dim
    256 in bf16 on a ~100 KB part that allows at most 32 rows and 32 keys a tile over two
    stages (16 + 2 * 32 KB); on a ~230 KB part 64 and 64 (32 + 2 * 64 KB).
    """
    block_m = 16 if rows <= 16 else (32 if rows <= 32 else 64)
    if head_dim <= 128:
        return AttentionConfig(block_m, 64, 4, 3)
    if capability in _LARGE_SHARED_MEMORY:
        return AttentionConfig(block_m, 64, 8, 2)
    return AttentionConfig(min(block_m, 32), 32, 4, 2)


def choose_num_splits(
    multiprocessors: int, row_blocks: int, kv_heads: int, keys: int, block_n: int
) -> int:
    """Enough key splits to give every SM about two programs, with at least 4 key blocks each.

    `keys` is the length of the key buffer, not of the context: for a preallocated cache the
    split count, and so the grid, stays the same as the context grows (a captured graph's).
    """
    wanted = triton.cdiv(2 * multiprocessors, row_blocks * kv_heads)
    return max(1, min(wanted, triton.cdiv(keys, 4 * block_n)))


@functools.cache
def _device_facts(device: torch.device) -> tuple[int, tuple[int, int] | None]:
    """(multiprocessors, compute capability); (1, None) off CUDA (the interpreter)."""
    if device.type != "cuda":
        return 1, None
    props = torch.cuda.get_device_properties(device)
    return props.multi_processor_count, (props.major, props.minor)


def tree_attention(
    q: torch.Tensor,  # [T, Hq, D] (RoPE applied)
    k: torch.Tensor,  # [S, Hkv, D], S >= prefix_len + T
    v: torch.Tensor,  # [S, Hkv, D]
    prefix_len: int | torch.Tensor,  # an int, or an int64 tensor of one element on q's device
    tree_visible: torch.Tensor | None,  # [T, T] bool, None = causal
    scale: float,
    *,
    num_splits: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:  # [T, Hq, D] in q's dtype
    """Triton version of `reference.tree_attention`: same arguments, same result.

    `num_splits` (key ranges processed in parallel) and `block_n` (keys per step) override the
    launch choices; results do not depend on them beyond rounding.
    """
    T = q.shape[0]
    keys = k.shape[0]
    if isinstance(prefix_len, int) and keys < prefix_len + T:
        raise ValueError(f"{keys} keys for a prefix of {prefix_len} and {T} queries")
    k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (k, v))
    launch = _Launch(q, k, v, tree_visible, scale, T, keys, sequences=1)
    paged = dict(PREFIX_ON_DEVICE=isinstance(prefix_len, torch.Tensor), PAGED=False)
    strides = (0, *k.stride()[:2], 0, *v.stride()[:2], 0, 0)
    return launch.run(prefix_len, q, q, strides, paged, num_splits, block_n)


def paged_tree_attention(
    q: torch.Tensor,  # [N, Hq, D] the pending tokens of B sequences (RoPE applied)
    k_blocks: torch.Tensor,  # [blocks, block_tokens, Hkv, D]
    v_blocks: torch.Tensor,  # [blocks, block_tokens, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int64, on q's device
    query_starts: torch.Tensor,  # [B + 1] int64, on q's device
    prefix_lens: torch.Tensor,  # [B] int64, on q's device
    tree_visible: torch.Tensor | None,  # [N, Tmax] bool, None = causal
    scale: float,
    *,
    num_splits: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:  # [N, Hq, D] in q's dtype
    """Triton version of `reference.paged_tree_attention`: one launch for every sequence, each
    program reading its sequence's blocks through its table (no copy of the keys).

    The most queries of any sequence is read from the shapes, not the device: the mask's width,
    or without a mask N (programs past a sequence's queries return at once).
    """
    B, table_len = block_tables.shape
    block_tokens = k_blocks.shape[1]
    t_max = tree_visible.shape[1] if tree_visible is not None else q.shape[0]
    k_blocks, v_blocks = (x if x.stride(-1) == 1 else x.contiguous() for x in (k_blocks, v_blocks))
    launch = _Launch(
        q, k_blocks, v_blocks, tree_visible, scale, t_max, table_len * block_tokens, sequences=B
    )
    table = block_tables.contiguous()
    starts = query_starts.contiguous()
    strides = (*k_blocks.stride()[:3], *v_blocks.stride()[:3], table.stride(0), block_tokens)
    paged = dict(PREFIX_ON_DEVICE=True, PAGED=True)
    return launch.run(prefix_lens.contiguous(), table, starts, strides, paged, num_splits, block_n)


class _Launch:
    """What `tree_attention` and `paged_tree_attention` launch alike: the shapes, the launch
    configuration, the output and the key splits' scratch."""

    def __init__(self, q, k, v, tree_visible, scale, t_max: int, keys: int, sequences: int):
        Hq, D = q.shape[1:]
        Hkv = k.shape[-2]
        if Hq % Hkv:
            raise ValueError(f"{Hq} query heads do not share {Hkv} kv heads evenly")
        if compute_dtype(q.dtype) == torch.float64:
            # A float argument reaches a kernel as float32: fold the scale in exactly instead.
            q, scale = q * scale, 1.0
        # Any layout whose head dim is dense (a slice of a preallocated cache) is read in place.
        self.q = q if q.stride(-1) == 1 else q.contiguous()
        self.k, self.v, self.scale = k, v, float(scale)
        self.t_max, self.keys, self.sequences = t_max, keys, sequences
        self.Hq, self.Hkv, self.D, self.group = Hq, Hkv, D, Hq // Hkv
        self.causal = tree_visible is None
        self.visible = (
            self.q
            if self.causal
            else tree_visible.to(device=q.device, dtype=torch.int8).contiguous()
        )

    def run(self, prefix, table, starts, strides, paged, num_splits, block_n) -> torch.Tensor:
        q, rows_total = self.q, self.q.shape[0]
        out = torch.empty_like(q)
        if rows_total == 0 or self.t_max == 0:
            return out
        multiprocessors, capability = _device_facts(q.device)
        cfg = attention_config(capability, self.D, self.t_max * self.group)
        block_n = block_n or cfg.block_n
        row_blocks = triton.cdiv(self.t_max * self.group, cfg.block_m)
        splits = num_splits or choose_num_splits(
            multiprocessors, row_blocks * self.sequences, self.Hkv, self.keys, block_n
        )
        compute = compute_dtype(q.dtype)
        shape = (splits, rows_total, self.Hq)
        partial = torch.empty(*shape, self.D, dtype=compute, device=q.device) if splits > 1 else out
        lse = torch.empty(shape, dtype=compute, device=q.device) if splits > 1 else out
        visible_stride = 0 if self.causal else self.visible.stride(0)
        block_d = max(16, triton.next_power_of_2(self.D))
        _tree_attention_kernel[(row_blocks, self.Hkv, self.sequences * splits)](
            q, self.k, self.v, self.visible, out, partial, lse, prefix, table, starts,
            q.stride(0), q.stride(1), *strides, visible_stride,
            self.t_max, rows_total, self.Hkv, self.keys, splits, self.scale,
            D=self.D, GROUP=self.group, CAUSAL=self.causal, **paged,
            COMPUTE=tl_compute_dtype(q.dtype), DOT=tl_dot_dtype(q.dtype),
            BLOCK_M=cfg.block_m, BLOCK_N=block_n, BLOCK_D=block_d,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip
        if splits > 1:
            _merge_splits_kernel[(rows_total * self.Hq,)](
                partial, lse, out, rows_total * self.Hq, splits,
                D=self.D, COMPUTE=tl_compute_dtype(q.dtype), BLOCK_D=block_d,
            )  # fmt: skip
        return out
