"""Dense projections on the kernels that stream weights fastest on the device at hand.

A decode step is a matrix-vector product per weight, bound by how fast the weight is read from memory.
Measured on the 2-core CI machines (bench/decode_roofline.py, docs/BENCHMARKS.md):

- `F.linear` runs a one-row float32 product on one core (about 15 GB/s) and a float32 prefill GEMM at half of
  oneDNN's speed;
- a batched product with one batch entry per core (`torch.bmm` over column groups) reads float32 weights at
  about 30 GB/s, the best one-row kernel here;
- oneDNN's linear (`mkldnn._linear_pointwise`, the kernel torch's own compiler emits for CPU linears) is the
  fastest for many rows, and for bfloat16.

So on the CPU float32 weights are stored once, transposed, as [in, out]: one-row products run one bmm over
SPLIT column groups (a strided view [SPLIT, in, out / SPLIT] of that memory), many-row products one oneDNN
call on the transposed view [out, in] (measured 10-25% faster at 64 rows than a call per group plus a concat).
bfloat16 weights stay [out, in] for oneDNN. GPUs, and torch builds without oneDNN, use `F.linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SPLIT = 2  # column groups of the CPU float32 layout: one per core of the machines we measured


def _onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _onednn(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")


class Linear:
    """y = x @ weight.T + bias, for x [M, in], with the weight given as [out, in] (the Hugging Face layout)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, *, dtype: torch.dtype,
                 device: torch.device):
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else bias.to(device=device, dtype=dtype)
        cpu = device.type == "cpu" and _onednn_available()
        self.kernel = "split" if cpu and dtype == torch.float32 else "onednn" if cpu and dtype == torch.bfloat16 \
            else "linear"
        if self.kernel == "split":
            padded = -(-self.out_features // SPLIT) * SPLIT
            w = weight.to(dtype)
            if padded != self.out_features:
                w = torch.cat([w, w.new_zeros(padded - self.out_features, self.in_features)])
            self.weight = w.t().contiguous().to(device)  # [in, padded out]
            # Group g = output columns [g * out / SPLIT, (g + 1) * out / SPLIT): a view, no copy.
            self._groups = self.weight.view(self.in_features, SPLIT, padded // SPLIT).permute(1, 0, 2)
        else:
            self.weight = weight.to(device=device, dtype=dtype).contiguous()

    @property
    def nbytes(self) -> int:
        """Bytes read from memory per product (the weight and the bias)."""
        total = self.weight.numel() * self.weight.element_size()
        return total + (0 if self.bias is None else self.bias.numel() * self.bias.element_size())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel == "linear":
            return F.linear(x, self.weight, self.bias)
        if self.kernel == "onednn":
            out = _onednn(x, self.weight)
        elif x.shape[0] == 1:
            out = torch.bmm(x.unsqueeze(0).expand(SPLIT, 1, self.in_features), self._groups).view(1, -1)
        else:
            out = _onednn(x, self.weight.t())
        if out.shape[1] != self.out_features:
            out = out[:, : self.out_features]
        return out if self.bias is None else out + self.bias
