"""4-bit weights kept packed: GGUF Q4_0/Q4_1 blocks, or any float weight quantized group-wise, run on torch's int4
CPU kernel instead of being expanded.

A Q4_0/Q4_1 block holds 32 weights of one row as 4-bit codes c with one scale d and one offset m (Q4_0:
m = -8d), w = d * c + m. torch's kernel computes w = (c - 8) * scale + zero for groups of 32 along the input
dimension, so the block maps exactly with scale = d and zero = m + 8d. The kernel computes in bfloat16 and
reads about 0.6 bytes per weight instead of 2 (bfloat16) or 4 (float32).

A float weight (a Hugging Face folder's, or a GGUF layer of another type) is quantized the same way
(`Int4Weight.quantize`): each group of `group` weights along a row (32, 64 or 128) gets its own scale and offset,
from the group's minimum and maximum, so the 16 codes span exactly the values the group holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GROUP = 32  # weights per GGUF Q4 block, and the kernel's default group size
GROUPS = (32, 64, 128)  # group sizes the kernel takes for quantized float weights
_ROW_MULTIPLE = 16  # the packing kernel needs the output dimension to be a multiple of 16


@dataclass
class Int4Weight:
    """codes: uint8 [out, in] in 0..15; scale, offset: float32 [out, in / group]; w = scale * code + offset for the
    weights of each group of `group` along a row."""

    codes: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor
    group: int = GROUP

    @classmethod
    def quantize(cls, weight: torch.Tensor, group: int = GROUP) -> Int4Weight:
        """weight [out, in] (float) quantized asymmetrically per group: scale = (max - min) / 15, offset = min.
        Raises ValueError for a group size the kernel does not take or that does not divide in."""
        if group not in GROUPS:
            raise ValueError(f"int4 groups of {group} weights: the kernel takes {', '.join(map(str, GROUPS))}")
        out_features, in_features = weight.shape
        if in_features % group:
            raise ValueError(f"int4 weights need in_features divisible by the group ({group}), got {in_features}")
        w = weight.float().view(out_features, in_features // group, group)
        low, high = w.amin(dim=2), w.amax(dim=2)
        scale = ((high - low) / 15).clamp_min(1e-12)
        codes = torch.round((w - low[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.uint8)
        return cls(codes.view(out_features, in_features), scale, low, group)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def dequantize(self) -> torch.Tensor:
        """float32 [out, in]."""
        scale = self.scale.repeat_interleave(self.group, dim=1)
        offset = self.offset.repeat_interleave(self.group, dim=1)
        return self.codes.to(torch.float32) * scale + offset

    @staticmethod
    def cat(parts: list[Int4Weight]) -> Int4Weight:
        """Stacks weights of one group size along the output dimension (fusing Q/K/V or gate/up)."""
        if len({p.group for p in parts}) != 1:
            raise ValueError(f"cannot fuse int4 weights of group sizes {sorted({p.group for p in parts})}")
        return Int4Weight(torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]),
                          torch.cat([p.offset for p in parts]), parts[0].group)


class Int4Linear:
    """y = x @ w.T + bias for bfloat16 x [M, in], with w held packed (see the module docstring). The caller
    checks that the kernel runs here (CpuFeatures.int4)."""

    kernel = "int4"  # as Linear.kernel names its kernel

    def __init__(self, weight: Int4Weight, bias: torch.Tensor | None, *, device: torch.device):
        if device.type != "cpu":
            raise ValueError("packed 4-bit weights run on the CPU only (torch's int4 CPU kernel)")
        out_features, in_features = weight.shape
        if in_features % weight.group:
            raise ValueError(f"packed 4-bit weights need in_features divisible by {weight.group}, got {in_features}")
        self.out_features, self.in_features, self.group = out_features, in_features, weight.group
        rows = -(-out_features // _ROW_MULTIPLE) * _ROW_MULTIPLE
        codes, scale, zero = weight.codes.to(torch.int32), weight.scale, weight.offset + 8 * weight.scale
        if rows != out_features:  # zero rows produce zero outputs, sliced off in __call__
            pad = rows - out_features
            codes = torch.cat([codes, codes.new_zeros(pad, in_features)])
            scale = torch.cat([scale, scale.new_zeros(pad, scale.shape[1])])
            zero = torch.cat([zero, zero.new_zeros(pad, zero.shape[1])])
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.contiguous(), 1)
        # [in / group, out, 2]: (scale, zero) per group and output row.
        self.scales_zeros = torch.stack([scale.t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous()
        self.bias = None if bias is None else bias.to(torch.bfloat16)

    @property
    def nbytes(self) -> int:
        total = self.packed.numel() * self.packed.element_size()
        total += self.scales_zeros.numel() * self.scales_zeros.element_size()
        return total + (0 if self.bias is None else self.bias.numel() * self.bias.element_size())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group, self.scales_zeros)
        if out.shape[1] != self.out_features:
            out = out[:, : self.out_features]
        return out if self.bias is None else out + self.bias
