"""8-bit weights: each output channel (row) of a projection quantized symmetrically to int8 with one scale.

w[o, i] ~ scale[o] * code[o, i], code in -127..127, scale[o] = max_i |w[o, i]| / 127: computed from the weight
itself, so any checkpoint (a Hugging Face folder's floats, a GGUF file's expanded blocks) quantizes the same way.
A product reads one byte per weight instead of two (bfloat16) or four (float32): decode, bound by reading the
weights, gets faster by about that ratio.

The kernel is torch's int8 weight-only product (`_weight_int8pack_mm`: x [M, in] in bfloat16 times the codes,
times the scales), on the CPU and, where this torch build has it, on CUDA; otherwise CUDA multiplies by the codes
widened to x's dtype (correct, without the speed-up; `Int8Linear.kernel` says which ran). Activations stay in
bfloat16: the kernel's float32 path is a generic loop several times slower than float32 `F.linear`.
"""

from __future__ import annotations

import torch

QMAX = 127  # symmetric: -128 is never used, so a code and its negation are both representable
_TINY = 1e-12  # an all-zero row gets a tiny scale (its codes are zero either way), never a division by zero


def quantize_rows(weight: torch.Tensor, scale_dtype: torch.dtype = torch.float32
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] (any float dtype) -> (codes int8 [out, in], scale [out] in scale_dtype), per output
    channel. The codes are computed against the scale as scale_dtype holds it (the kernel multiplies by that):
    rounding a bfloat16 scale after the fact would scale a whole channel off by up to 0.4%."""
    w = weight.float()
    scale = (w.abs().amax(dim=1).clamp_min(_TINY) / QMAX).to(scale_dtype)
    codes = torch.round(w / scale.float()[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return codes, scale


class Int8Linear:
    """y = x @ w.T + bias for x [M, in] in `dtype` (bfloat16 on the CPU), w held as int8 codes with one scale per
    output channel (see the module docstring)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, *, dtype: torch.dtype, device: torch.device):
        """weight: the float weight [out, in] (float32 preferred: it is quantized from what it holds)."""
        self.out_features, self.in_features = weight.shape
        codes, scale = quantize_rows(weight, dtype)
        self.codes = codes.to(device).contiguous()
        self.scale = scale.to(device)
        self.bias = None if bias is None else bias.to(device=device, dtype=dtype)
        self.kernel = "int8" if _packed_kernel_runs(device, dtype) else "int8 widened"

    @property
    def nbytes(self) -> int:
        total = self.codes.numel() + self.scale.numel() * self.scale.element_size()
        return total + (0 if self.bias is None else self.bias.numel() * self.bias.element_size())

    def dequantize(self) -> torch.Tensor:
        """float32 [out, in]: what the codes and scales stand for."""
        return self.codes.float() * self.scale.float()[:, None]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel == "int8":
            out = torch.ops.aten._weight_int8pack_mm(x, self.codes, self.scale)
        else:
            out = torch.nn.functional.linear(x, self.codes.to(x.dtype)) * self.scale
        return out if self.bias is None else out + self.bias


_runs: dict[tuple[str, torch.dtype], bool] = {}


def _packed_kernel_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch's int8 weight-only kernel runs on this device type for this activation dtype (probed once:
    CPU builds have it; CUDA builds only from some versions on)."""
    key = (device.type, dtype)
    if key not in _runs:
        try:
            x = torch.ones(1, 32, dtype=dtype, device=device)
            codes = torch.ones(8, 32, dtype=torch.int8, device=device)
            out = torch.ops.aten._weight_int8pack_mm(x, codes, torch.ones(8, dtype=dtype, device=device))
            _runs[key] = bool(torch.allclose(out.float().cpu(), torch.full((1, 8), 32.0)))
        except (RuntimeError, NotImplementedError):
            _runs[key] = False
    return _runs[key]
