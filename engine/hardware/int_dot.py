"""tandem's integer-dot CPU kernels (engine/hardware/csrc/int_dot.cpp, part of the extension cpu_kernels.py loads):
y = x @ w.T with w held as GGUF blocks as llama.cpp stores them, each row of x
quantized per block of 32 to int8, and the products summed as integer dot products.

    Q4_1  20 bytes per 32 weights: fp16 d, fp16 m, 16 bytes of 4-bit codes; w = d * code + m
    Q8_0  34 bytes per 32 weights: fp16 d, 32 int8 codes; w = d * code

Paths (cpu_kernels.PATHS): AVX-512 VNNI (vpdpbusd), AVX2 (vpmaddubsw), and plain C++; the library runs on any x86-64
CPU and says which paths this CPU has (`supported_paths`). Which one a process uses is the CPU probe's choice
(engine/hardware/cpu_features.py: `cpu_kernels`, `cpu_kernels_avx512`; cpu_kernels.kernel_path), so
TANDEM_CPU_DISABLE=cpu_kernels_avx512 takes the AVX2 path on an AVX-512 machine and TANDEM_CPU_DISABLE=cpu_kernels
leaves the kernels out.

This module packs weights into the kernels' blocks (`q4_1_blocks`, `q8_0_blocks`: 8 rows interleaved, the same
bytes per weight as GGUF's) and calls the ops; it needs torch only.
"""

from __future__ import annotations

import torch

BLOCK = 32  # weights per block


ROWS = 8  # weight rows interleaved in one group of blocks


def _fp16_bytes(values: torch.Tensor) -> torch.Tensor:
    """float values [..., n] -> their fp16 bytes [..., n * 2] as uint8."""
    return values.to(torch.float16).contiguous().view(torch.uint8).reshape(*values.shape[:-1], -1)


def _grouped(t: torch.Tensor, fill: float = 0) -> torch.Tensor:
    """t [N, ...] padded with `fill` rows to a multiple of ROWS, as [N / ROWS, ROWS, ...]."""
    pad = -t.shape[0] % ROWS
    if pad:
        t = torch.cat([t, t.new_full((pad, *t.shape[1:]), fill)])
    return t.view(-1, ROWS, *t.shape[1:])


def _interleaved(codes: torch.Tensor) -> torch.Tensor:
    """codes [N, K] -> [groups, blocks, 8 chunks, 32]: chunk c of a block holds weights 4c..4c+3 of each of the
    group's 8 rows in turn (one 32-bit lane a row, as the kernels' vectors take them)."""
    n, k = codes.shape
    grouped = _grouped(codes).view(-1, ROWS, k // BLOCK, BLOCK // 4, 4)  # [G, row, block, chunk, 4]
    return grouped.permute(0, 2, 3, 1, 4).reshape(-1, k // BLOCK, BLOCK // 4, ROWS * 4)


def _per_block(values: torch.Tensor) -> torch.Tensor:
    """Per-row block values [N, blocks] -> each group's [groups, blocks, 8 rows] fp16 bytes [groups, blocks, 16]."""
    return _fp16_bytes(_grouped(values.float()).permute(0, 2, 1))


def q4_1_blocks(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """codes uint8 [N, K] in 0..15, scale and offset [N, K / 32] (w = scale * code + offset per block) -> the
    kernels' Q4_1 groups: uint8 [ceil(N / 8), K / 32 * 160], each block of 8 rows as fp16 d x 8, fp16 m x 8 and 128
    bytes of codes (chunks 0-3 in the low nibbles, 4-7 in the high ones); padding rows are zero. The same 20 bytes
    per 32 weights as a GGUF Q4_1 block, with fp16 scales: exact for weights read from a GGUF file."""
    n, k = codes.shape
    if k % BLOCK:
        raise ValueError(f"Q4_1 blocks need K divisible by {BLOCK}, got {k}")
    chunks = _interleaved(codes.to(torch.uint8))
    nibbles = (chunks[:, :, :4] | (chunks[:, :, 4:] << 4)).flatten(2)
    blocks = torch.cat([_per_block(scale), _per_block(offset), nibbles], dim=-1)
    return blocks.reshape(blocks.shape[0], -1).contiguous()


def q8_0_blocks(weight: torch.Tensor) -> torch.Tensor:
    """float weight [N, K] quantized as llama.cpp's Q8_0 (d = max|w| / 127 per block, code = round(w / d)) -> the
    kernels' Q8_0 groups: uint8 [ceil(N / 8), K / 32 * 272], each block of 8 rows as fp16 d x 8 and 256 int8 codes in
    chunks as Q4_1's (34 bytes per 32 weights, as GGUF's Q8_0). A weight dequantized from Q8_0 blocks gives those
    same codes and scales back."""
    n, k = weight.shape
    if k % BLOCK:
        raise ValueError(f"Q8_0 blocks need K divisible by {BLOCK}, got {k}")
    w = weight.float().view(n, k // BLOCK, BLOCK)
    d = w.abs().amax(dim=-1) / 127
    inverse = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    codes = torch.round(w * inverse[..., None]).clamp_(-127, 127).to(torch.int8).view(n, k)
    chunks = _interleaved(codes.view(torch.uint8)).flatten(2)
    blocks = torch.cat([_per_block(d), chunks], dim=-1)
    return blocks.reshape(blocks.shape[0], -1).contiguous()


WIDE_LIMIT = 127 * 256 + 127  # the wide codes' bound (int_dot.cpp kWideMax): each splits in two int8 halves


def q4_1_linear(x: torch.Tensor, blocks: torch.Tensor, n: int, path: int = 0, *, wide: bool = False) -> torch.Tensor:
    """x [M, K] (float32 or bfloat16) @ the first n rows of the Q4_1 groups' weights [N, K].T -> [M, n] in x's
    dtype. wide: x quantized to int16 per block instead of int8 (activations kept to 1/WIDE_LIMIT of each block's
    largest rather than 1/127: for inputs whose blocks mix a few large values with small ones), at about twice
    the arithmetic (the SIMD paths run the int8 products on each int8 half of the codes)."""
    if wide:
        return torch.ops.tandem_cpu.q4_1_linear_wide(x, blocks, n, path)
    return torch.ops.tandem_cpu.q4_1_linear(x, blocks, n, path)


def q8_0_linear(x: torch.Tensor, blocks: torch.Tensor, n: int, path: int = 0) -> torch.Tensor:
    """x [M, K] @ the first n rows of the Q8_0 groups' weights [N, K].T -> [M, n] in x's dtype."""
    return torch.ops.tandem_cpu.q8_0_linear(x, blocks, n, path)


def quantize_rows(x: torch.Tensor, *, wide: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The activations as the kernels quantize them: codes [M, K] (int8, or int16 when wide) and per-block scales
    [M, K / 32] (float32), x ~= codes * scale. The tests' reference."""
    m, k = x.shape
    limit = WIDE_LIMIT if wide else 127
    blocks = x.float().view(m, k // BLOCK, BLOCK)
    d = blocks.abs().amax(dim=-1) / limit
    inverse = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    codes = torch.round(blocks * inverse[..., None]).clamp_(-limit, limit)
    return codes.view(m, k).to(torch.int16 if wide else torch.int8), d
