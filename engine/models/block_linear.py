"""Projections held as GGUF blocks and run on tandem's integer-dot kernels (engine/hardware/int_dot.py): a Q4_1
projection from a packed 4-bit weight of groups of 32 (a GGUF file's Q4_0/Q4_1 layers, exactly as stored), and a
Q8_0 LM head from the token embedding (a GGUF file's Q8_0 embedding gives its own blocks back). Each reads its
blocks once per call however many rows x has (four rows a pass over a weight row in L1), about 0.63 bytes a weight
for Q4_1 and 1.06 for Q8_0, against 2 for a bfloat16 head.

A prompt of many rows is computed by the kernels too when `Linear`-style dense work would not pay: the caller
(ProjectionBuilder) decides which projections take these, from the CPU probe's `int_dot`.
"""

from __future__ import annotations

import weakref

import torch

from tandem.engine.hardware.int_dot import q4_1_blocks, q8_0_blocks
from tandem.engine.models.int4 import GROUP, Int4Weight


class BlockLinear:
    """y = x @ w.T + bias for x [M, in] (bfloat16 or float32), w held as blocks (`format`: "q4_1" or "q8_0");
    the output has x's dtype. path: the kernels' path (engine/hardware/cpu_kernels.py PATHS; 0: the best here)."""

    def __init__(self, blocks: torch.Tensor, fmt: str, out_features: int, in_features: int,
                 bias: torch.Tensor | None, *, path: int = 0, wide: bool = False):
        self.blocks, self.format, self.path, self.wide = blocks, fmt, path, wide
        self.out_features, self.in_features = out_features, in_features
        self.bias = bias
        # The kernels hold the blocks under a handle, so that a call (and a compiled graph) passes an int, not the
        # weight; given back when this projection goes.
        self.handle = torch.ops.tandem_cpu.register_blocks(blocks)
        weakref.finalize(self, torch.ops.tandem_cpu.release_blocks, self.handle).atexit = False

    kernel = "int_dot"  # as Linear.kernel names its kernel
    GROUP = GROUP  # the weights of a block
    traceable = True  # one torch op (and a bias add): the compiled step calls it from its graph

    @classmethod
    def q4_1(cls, weight: Int4Weight, bias: torch.Tensor | None, *, path: int = 0, wide: bool = False) -> BlockLinear:
        """From a packed weight of groups of 32 (wide: its inputs quantized to int16, engine/hardware/int_dot.py).
        Raises ValueError for another group size."""
        if weight.group != GROUP:
            raise ValueError(f"Q4_1 blocks hold groups of {GROUP} weights, got groups of {weight.group}")
        return cls(q4_1_blocks(weight.codes, weight.scale, weight.offset), "q4_1", *weight.shape,
                   None if bias is None else bias.to(torch.bfloat16), path=path, wide=wide)

    @classmethod
    def q8_0(cls, weight: torch.Tensor, bias: torch.Tensor | None, *, path: int = 0) -> BlockLinear:
        """From a float weight [out, in] (quantized per block of 32, as llama.cpp's Q8_0)."""
        return cls(q8_0_blocks(weight), "q8_0", *weight.shape, bias, path=path)

    @property
    def kind(self) -> int:
        """The kernels' kind of product (int_dot.cpp Kind): Q4_1 with int8 or int16 activations, or Q8_0."""
        return 2 if self.format == "q8_0" else 1 if self.wide else 0

    @property
    def nbytes(self) -> int:
        total = self.blocks.numel()
        return total + (0 if self.bias is None else self.bias.numel() * self.bias.element_size())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.tandem_cpu.block_project(x, self.handle, self.out_features, self.path, self.kind)
        return out if self.bias is None else out + self.bias.to(out.dtype)
