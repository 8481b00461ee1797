"""Fused elementwise kernels in Triton for the layers around attention: RMSNorm with the residual add folded in
(h = h + delta; x = rms_norm(h) * weight in one pass over h), and rotary embeddings applied to Q and K in place
from the model's cos/sin tables (half-split, rotate_half layout). One program per token row; math in fp32, results
rounded to the input dtype exactly where the reference rounds.

Triton is imported here only; on the CPU the kernels run under TRITON_INTERPRET=1 (set before import).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, delta_ptr, weight_ptr, out_ptr, res_out_ptr, n_cols, eps, stride_x, stride_d,
                     stride_o, stride_r, HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    dtype = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_DELTA:  # the residual add, rounded to the stream's dtype as the reference's h + delta is
        x = (x + tl.load(delta_ptr + row * stride_d + cols, mask=ok, other=0.0).to(tl.float32)).to(
            dtype, fp_downcast_rounding="rtne")
        tl.store(res_out_ptr + row * stride_r + cols, x, mask=ok)
        x = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    weight = tl.load(weight_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    normed = (x * inv_rms).to(dtype, fp_downcast_rounding="rtne").to(tl.float32)  # fp32, rounded, then scaled
    tl.store(out_ptr + row * stride_o + cols, (normed * weight).to(dtype, fp_downcast_rounding="rtne"), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             delta: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x, delta: [T, H]. Returns (rms_norm(x + delta) * weight, x + delta); without delta, (rms_norm(x) * weight,
    x). The sum is computed once and returned as the new residual stream."""
    t, h = x.shape
    out = torch.empty_like(x)
    residual = torch.empty_like(x) if delta is not None else x
    _rms_norm_kernel[(t,)](x, delta if delta is not None else x, weight, out, residual, h, eps, x.stride(0),
                           (delta if delta is not None else x).stride(0), out.stride(0), residual.stride(0),
                           HAS_DELTA=delta is not None, BLOCK=triton.next_power_of_2(h))
    return out, residual


@triton.jit
def _rotary_kernel(x_ptr, positions_ptr, cos_ptr, sin_ptr, n_heads, stride_t, stride_h, stride_table,
                   HALF: tl.constexpr, HEADS_PAD: tl.constexpr):
    token = tl.program_id(0)
    pos = tl.load(positions_ptr + token)
    heads = tl.arange(0, HEADS_PAD)
    cols = tl.arange(0, HALF)
    ok = heads[:, None] < n_heads
    base = x_ptr + token * stride_t + heads[:, None] * stride_h + cols[None, :]
    x1 = tl.load(base, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=ok, other=0.0).to(tl.float32)
    cos = tl.load(cos_ptr + pos * stride_table + cols).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + pos * stride_table + HALF + cols).to(tl.float32)[None, :]  # the table's +sin half
    tl.store(base, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=ok)
    tl.store(base + HALF, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=ok)


def rotary_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotates x [T, heads, head_dim] in place by the tables of RotaryEmbedding (cos, signed_sin: [positions,
    head_dim], the sign of the first half folded in) at positions [T]; returns x. head_dim must be even, its half
    a power of two."""
    t, heads, d = x.shape
    if d % 2 or (d // 2) & (d // 2 - 1) or x.stride(2) != 1:
        raise ValueError(f"rotary needs a contiguous head_dim whose half is a power of two, got {d}")
    _rotary_kernel[(t,)](x, positions.contiguous(), cos, signed_sin, heads, x.stride(0), x.stride(1), cos.stride(0),
                         HALF=d // 2, HEADS_PAD=triton.next_power_of_2(heads))
    return x
