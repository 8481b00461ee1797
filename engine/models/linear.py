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

Which of these a CPU can run is probed (engine/cpu_features.py), never assumed. oneDNN's bfloat16 inner product
does not run on AVX2-only CPUs; there bfloat16 weights stay bfloat16 in memory and ("widen") products of up to
15 rows run `F.linear` in bfloat16, larger ones widen the weight to float32 a chunk of rows at a time into a
reused buffer and multiply in float32. Both accumulate in float32 and round the output once, as oneDNN does.
Measured on a 2-core AVX2 EPYC (bench/linear_kernels.py, 960x576 .. 49152x576 weights): bfloat16 `F.linear` is
on par with the float32 bmm at one row and ahead of widening at 4 rows, but 4-8x slower than float32 from 64
rows on, where widening in chunks is 4-8x faster than it (2-3x at 16 rows); 8 rows is about even.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

from tandem.engine.cpu_features import CpuFeatures, cpu_features

SPLIT = 2  # column groups of the CPU float32 layout: one per core of the machines we measured
KERNELS = {
    "split": "float32 column-split bmm (one row), oneDNN (more rows)",
    "onednn": "oneDNN bfloat16",
    "widen": "bfloat16 F.linear (up to 15 rows), float32 over widened weight chunks (more rows)",
    "linear": "F.linear",
}
WIDEN_FROM_ROWS = 16  # AVX2, bench/linear_kernels.py: F.linear wins at 4 rows, even at 8, widening from 16
WIDEN_CHUNK_ELEMENTS = 1 << 19  # weight elements widened at a time (2 MiB of float32)
_widen_buffer = threading.local()  # one float32 scratch per thread, reused: fresh pages cost a fault each


def choose_kernel(dtype: torch.dtype, device: torch.device, cpu: CpuFeatures | None = None) -> str:
    """The KERNELS entry for weights of `dtype` on `device`; `cpu` (default: this process's probe) says what
    the CPU runs."""
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return "linear"
    cpu = cpu or cpu_features()
    if dtype == torch.float32:
        return "split" if cpu.onednn else "linear"
    return "onednn" if cpu.onednn_bf16 else "widen"


def _onednn(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")


def _widened(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, in] @ weight[out, in].T in float32, the weight widened chunk by chunk; the result in x's dtype."""
    out_features, in_features = weight.shape
    rows = max(1, WIDEN_CHUNK_ELEMENTS // in_features)
    buffer = getattr(_widen_buffer, "tensor", None)
    if buffer is None or buffer.numel() < rows * in_features:
        with torch.inference_mode(False):  # a normal tensor: writable inside and outside inference mode
            buffer = _widen_buffer.tensor = torch.empty(rows * in_features, dtype=torch.float32)
    wide = x.float()
    out = torch.empty(x.shape[0], out_features, dtype=x.dtype)
    for start in range(0, out_features, rows):
        chunk = weight[start:start + rows]
        out[:, start:start + chunk.shape[0]] = F.linear(wide, buffer[: chunk.numel()].view(chunk.shape).copy_(chunk))
    return out


class Linear:
    """y = x @ weight.T + bias, for x [M, in], with the weight given as [out, in] (the Hugging Face layout)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, *, dtype: torch.dtype,
                 device: torch.device, cpu: CpuFeatures | None = None):
        """cpu: what this CPU runs (default: this process's probe); `kernel` names the KERNELS entry chosen."""
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else bias.to(device=device, dtype=dtype)
        self.kernel = choose_kernel(dtype, device, cpu)
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
        elif self.kernel == "widen":
            out = F.linear(x, self.weight) if x.shape[0] < WIDEN_FROM_ROWS else _widened(x, self.weight)
        elif x.shape[0] == 1:
            out = torch.bmm(x.unsqueeze(0).expand(SPLIT, 1, self.in_features), self._groups).view(1, -1)
        else:
            out = _onednn(x, self.weight.t())
        if out.shape[1] != self.out_features:
            out = out[:, : self.out_features]
        return out if self.bias is None else out + self.bias
