"""Triton kernels: the fused layer pieces, each one launch where plain torch makes several.

Match `rms_norm`, `add_rms_norm`, `apply_rotary` and `silu_mul` in engine/kernels/reference.py
(the specification), rounding to the output dtype exactly where the reference's torch ops round
(each torch elementwise op on bf16 computes in float32 and rounds its result), so bf16 outputs
differ from the reference's by the order of a reduction at most.

- RMSNorm: one program per row (a token's hidden vector, or one head of it); with a residual,
  the same program adds it first and writes the sum too (the next residual stream).
- RoPE: one program per token and block of heads; the cos / sin row is loaded once for them.
- SiLU-multiply: one program per row and block of columns.

No host syncs and no data-dependent Python: every launch can be captured in a CUDA graph.
Run on CPU with TRITON_INTERPRET=1 set before this module is imported (tests do).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.triton_common import tl_compute_dtype


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [rows, N], row stride x_stride
    delta_ptr,  # [rows, N], row stride delta_stride (unused without HAS_DELTA)
    sum_ptr,  # [rows, N] contiguous: x + delta (unused without HAS_DELTA)
    weight_ptr,  # [N]
    out_ptr,  # [rows, N] contiguous
    x_stride,
    delta_stride,
    N,
    eps,
    HAS_DELTA: tl.constexpr,
    ZERO_CENTERED: tl.constexpr,
    COMPUTE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    ok = cols < N
    x = tl.load(x_ptr + row * x_stride + cols, mask=ok, other=0.0).to(COMPUTE)
    if HAS_DELTA:
        delta = tl.load(delta_ptr + row * delta_stride + cols, mask=ok, other=0.0).to(COMPUTE)
        summed = (x + delta).to(sum_ptr.dtype.element_ty)  # rounded, as torch's add rounds
        tl.store(sum_ptr + row * N + cols, summed, mask=ok)
        x = summed.to(COMPUTE)
    normed = x * tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
    weight = tl.load(weight_ptr + cols, mask=ok, other=0.0).to(COMPUTE)
    if ZERO_CENTERED:
        y = normed * (1.0 + weight)
    else:
        y = normed.to(x_ptr.dtype.element_ty).to(COMPUTE) * weight
    tl.store(out_ptr + row * N + cols, y.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _rotary_kernel(
    x_ptr,  # [tokens, H, D], strides (x_stride_t, x_stride_h, 1)
    cos_ptr,  # [tokens, R], row stride cos_stride
    sin_ptr,  # [tokens, R], row stride sin_stride
    out_ptr,  # [tokens, H, D] contiguous
    x_stride_t,
    x_stride_h,
    cos_stride,
    sin_stride,
    H,
    D: tl.constexpr,
    HALF: tl.constexpr,  # R // 2
    COMPUTE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_REST: tl.constexpr,  # 0 when every dim rotates
):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BH]
    head_ok = heads < H
    i = tl.arange(0, BLOCK_HALF)  # [BHALF]
    i_ok = i < HALF
    cos1 = tl.load(cos_ptr + token * cos_stride + i, mask=i_ok, other=0.0).to(COMPUTE)
    cos2 = tl.load(cos_ptr + token * cos_stride + HALF + i, mask=i_ok, other=0.0).to(COMPUTE)
    sin1 = tl.load(sin_ptr + token * sin_stride + i, mask=i_ok, other=0.0).to(COMPUTE)
    sin2 = tl.load(sin_ptr + token * sin_stride + HALF + i, mask=i_ok, other=0.0).to(COMPUTE)
    src = x_ptr + token * x_stride_t + heads[:, None] * x_stride_h  # [BH, 1]
    dst = out_ptr + (token * H + heads[:, None]) * D  # [BH, 1]
    mask = head_ok[:, None] & i_ok[None, :]
    x1 = tl.load(src + i[None, :], mask=mask, other=0.0).to(COMPUTE)  # [BH, BHALF]
    x2 = tl.load(src + HALF + i[None, :], mask=mask, other=0.0).to(COMPUTE)
    ROUND = out_ptr.dtype.element_ty  # where the reference's products and sums round
    first = (x1 * cos1[None, :]).to(ROUND).to(COMPUTE) - (x2 * sin1[None, :]).to(ROUND).to(COMPUTE)
    second = (x2 * cos2[None, :]).to(ROUND).to(COMPUTE) + (x1 * sin2[None, :]).to(ROUND).to(COMPUTE)
    tl.store(dst + i[None, :], first.to(ROUND), mask=mask)
    tl.store(dst + HALF + i[None, :], second.to(ROUND), mask=mask)
    if BLOCK_REST > 0:
        j = 2 * HALF + tl.arange(0, BLOCK_REST)
        rest_mask = head_ok[:, None] & (j < D)[None, :]
        rest = tl.load(src + j[None, :], mask=rest_mask, other=0.0)
        tl.store(dst + j[None, :], rest.to(ROUND), mask=rest_mask)


@triton.jit
def _silu_mul_kernel(
    gate_ptr,  # [rows, N], row stride gate_stride
    up_ptr,  # [rows, N], row stride up_stride
    out_ptr,  # [rows, N] contiguous
    gate_stride,
    up_stride,
    N,
    COMPUTE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    gate = tl.load(gate_ptr + row * gate_stride + cols, mask=ok, other=0.0).to(COMPUTE)
    up = tl.load(up_ptr + row * up_stride + cols, mask=ok, other=0.0).to(COMPUTE)
    activated = (gate * tl.sigmoid(gate)).to(gate_ptr.dtype.element_ty).to(COMPUTE)  # F.silu
    tl.store(out_ptr + row * N + cols, (activated * up).to(out_ptr.dtype.element_ty), mask=ok)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, N] with unit column stride: a view where the layout allows one."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _norm(x, delta, weight, eps: float, zero_centered: bool):
    """Launch the RMSNorm kernel; returns (normalised, x + delta or None)."""
    N = x.shape[-1]
    x_rows, weight = _rows(x), weight.contiguous()
    delta_rows = _rows(delta) if delta is not None else x_rows
    out_dtype = x.dtype if zero_centered else torch.promote_types(x.dtype, weight.dtype)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    summed = torch.empty_like(x) if delta is not None else out
    if x.numel():
        _rms_norm_kernel[(x_rows.shape[0],)](
            x_rows, delta_rows, summed, weight, out, x_rows.stride(0), delta_rows.stride(0),
            N, float(eps),
            HAS_DELTA=delta is not None, ZERO_CENTERED=zero_centered,
            COMPUTE=tl_compute_dtype(x.dtype), BLOCK_N=triton.next_power_of_2(N),
            num_warps=_warps(N),
        )  # fmt: skip
    return out, (summed if delta is not None else None)


def _warps(elements: int) -> int:
    """Warps for a program over `elements` values: ~8 values a thread, 1 to 16 warps."""
    return min(16, max(1, triton.next_power_of_2(elements) // 256))


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool = False
) -> torch.Tensor:
    """Triton version of `reference.rms_norm`: same arguments, same result."""
    return _norm(x, None, weight, eps, zero_centered)[0]


def add_rms_norm(
    x: torch.Tensor,
    delta: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    zero_centered: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of `reference.add_rms_norm`: same arguments, same results."""
    if delta.shape != x.shape or delta.dtype != x.dtype:
        raise ValueError(
            f"residual {tuple(x.shape)} {x.dtype}, delta {tuple(delta.shape)} {delta.dtype}"
        )
    return _norm(x, delta, weight, eps, zero_centered)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Triton version of `reference.apply_rotary`: same arguments, same result."""
    *lead, H, D = x.shape
    R = cos.shape[-1]
    if R % 2 or R > D:
        raise ValueError(f"rotary tables of width {R} for heads of {D}")
    tokens = x.reshape(-1, H, D)
    if tokens.stride(-1) != 1:
        tokens = tokens.contiguous()
    cos, sin = (t.expand(*lead, R).reshape(-1, R) for t in (cos, sin))
    out_dtype = torch.promote_types(x.dtype, cos.dtype)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    if x.numel():
        block_h = min(triton.next_power_of_2(H), 16)
        rest = D - R
        _rotary_kernel[(tokens.shape[0], triton.cdiv(H, block_h))](
            tokens, cos, sin, out, tokens.stride(0), tokens.stride(1), cos.stride(0), sin.stride(0),
            H,
            D=D, HALF=R // 2, COMPUTE=tl_compute_dtype(out_dtype), BLOCK_H=block_h,
            BLOCK_HALF=triton.next_power_of_2(max(R // 2, 1)),
            BLOCK_REST=triton.next_power_of_2(rest) if rest else 0,
            num_warps=_warps(block_h * D),
        )  # fmt: skip
    return out


_SILU_BLOCK = 1024


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Triton version of `reference.silu_mul`: same arguments, same result."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"gate {tuple(gate.shape)} {gate.dtype}, up {tuple(up.shape)} {up.dtype}")
    N = gate.shape[-1]
    gate_rows, up_rows = _rows(gate), _rows(up)
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if gate.numel():
        block = min(triton.next_power_of_2(N), _SILU_BLOCK)
        _silu_mul_kernel[(gate_rows.shape[0], triton.cdiv(N, block))](
            gate_rows, up_rows, out, gate_rows.stride(0), up_rows.stride(0), N,
            COMPUTE=tl_compute_dtype(gate.dtype), BLOCK=block, num_warps=_warps(block),
        )  # fmt: skip
    return out
