"""Dense projections on the kernel that is fastest for this CPU, weight shape and number of rows.

A decode step is a matrix-vector product per weight, bound by how fast the weight is read from memory; a prefill
chunk or a large decode batch is a matrix product bound by arithmetic. Which torch kernel does each best depends
on the CPU (AVX2 or AVX-512, caches, memory), the thread count and the shape (docs/BENCHMARKS.md: the column-split
`bmm` tuned on one AVX-512 CPU lost to oneDNN by up to 2x on an AVX2 one). So the candidates are listed here, and
at start-up each projection shape is timed on this CPU (engine/hardware/kernel_tuning.py: cached on disk per machine)
and gets a LinearPlan: one weight layout, and for each range of rows the fastest kernel on that layout.

Layouts (one per projection: the weight is stored once):
- rows: [out, in] as the checkpoint has it;
- columns: [in, out] (transposed once, padded to SPLIT column groups, which are strided views of it);
- blocked: oneDNN's own blocked layout (`mkldnn._reorder_linear_weight`), what torch's compiler feeds oneDNN.

Kernels (each on one layout, for the dtypes it lists, where the CPU probe says it runs):
- split: one `bmm` over SPLIT column groups, one batch entry per core (columns);
- onednn_t: oneDNN's linear on the transposed view of the columns layout (columns);
- linear: `F.linear` (rows; also every dtype and device without a kernel of its own);
- onednn: oneDNN's linear (rows);
- widen: bfloat16 weights widened to float32 a chunk of rows at a time into a reused buffer, multiplied in float32
  (rows; what beats bfloat16 `F.linear` for many rows on CPUs without oneDNN bfloat16);
- onednn_packed: oneDNN's linear on the blocked layout (blocked).
All accumulate in float32 and round the output once.

Which of these a CPU can run is probed (engine/hardware/cpu_features.py), never assumed. Without measurement
(TANDEM_KERNEL_TUNING=off) each dtype takes `fixed_plan`, the choices measured on the 2-core CI machines.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tandem.engine.hardware.cpu_features import CpuFeatures, cpu_features
from tandem.engine.hardware.kernel_tuning import BucketPlan, KernelTuner, copies_for, time_per_call

SPLIT = 2  # column groups of the columns layout: one per core of the machines we measured
LAYOUTS = {
    "rows": "[out, in]",
    "columns": "[in, out], column groups as views",
    "blocked": "oneDNN's blocked layout",
}


@dataclass(frozen=True)
class KernelSpec:
    """What a kernel (described in the module docstring) runs on: its layout, and the dtypes it runs."""

    layout: str
    needs: dict[torch.dtype, str | None]  # the dtypes it runs, each with the CpuFeatures flag it needs (or None)


_F32, _BF16 = torch.float32, torch.bfloat16
KERNELS = {
    "split": KernelSpec("columns", {_F32: None}),
    "onednn_t": KernelSpec("columns", {_F32: "onednn"}),
    "linear": KernelSpec("rows", {_F32: None, _BF16: None}),
    "onednn": KernelSpec("rows", {_F32: "onednn", _BF16: "onednn_bf16"}),
    "widen": KernelSpec("rows", {_BF16: None}),
    "onednn_packed": KernelSpec("blocked", {_F32: "onednn", _BF16: "onednn_bf16"}),
}
# Rows timed when tuning: batch-1 decode up to a prefill chunk. A product of r rows takes the kernel of the bucket
# nearest to r on a log scale.
ROW_BUCKETS = (1, 4, 16, 64, 256)
WIDEN_FROM_ROWS = 16  # fixed plan without oneDNN bfloat16 (2-core AVX2 EPYC, bench/linear_kernels.py)
WIDEN_CHUNK_ELEMENTS = 1 << 19  # weight elements widened at a time (2 MiB of float32)
COLD_ROWS = 4  # up to this many rows a product is timed over cold weights (kernel_tuning.copies_for)
BLOCKED_ROWS_HINT = 64  # oneDNN's reorder takes a batch size to block for; measured even for every hint from 4 up
_widen_buffer = threading.local()  # one float32 scratch per thread, reused: fresh pages cost a fault each


def candidates(dtype: torch.dtype, cpu: CpuFeatures) -> list[str]:
    """The KERNELS that run weights of `dtype` on this CPU."""
    return [name for name, spec in KERNELS.items()
            if dtype in spec.needs and (spec.needs[dtype] is None or getattr(cpu, spec.needs[dtype]))]


@dataclass(frozen=True)
class LinearPlan:
    """How one projection runs: its weight's layout, and the kernel (on that layout) by number of rows."""

    layout: str
    by_rows: BucketPlan

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"unknown layout {self.layout!r}; known: {', '.join(LAYOUTS)}")
        for kernel in self.by_rows.names():
            if KERNELS[kernel].layout != self.layout:
                raise ValueError(f"kernel {kernel!r} runs on the {KERNELS[kernel].layout} layout, not {self.layout}")

    @classmethod
    def of(cls, layout: str, *kernels: tuple[int, str]) -> LinearPlan:
        return cls(layout, BucketPlan(tuple(kernels)))

    def describe(self) -> str:
        return self.by_rows.describe("row")


def fixed_plan(dtype: torch.dtype, device: torch.device, cpu: CpuFeatures | None = None) -> LinearPlan:
    """The plan without measurement: what the probe says runs, with the choices measured on the CI machines."""
    if device.type != "cpu" or dtype not in (_F32, _BF16):
        return LinearPlan.of("rows", (1, "linear"))
    cpu = cpu or cpu_features()
    if dtype == _F32:
        return LinearPlan.of("columns", (1, "split"), (2, "onednn_t")) if cpu.onednn else \
            LinearPlan.of("rows", (1, "linear"))
    if cpu.onednn_bf16:
        return LinearPlan.of("rows", (1, "onednn"))
    return LinearPlan.of("rows", (1, "linear"), (WIDEN_FROM_ROWS, "widen"))


def tuned_plan(tuner: KernelTuner, dtype: torch.dtype, out_features: int, in_features: int) -> LinearPlan:
    """The plan measured on this CPU for an [out, in] weight of dtype (cached by the tuner). The layout is the one
    whose best kernels lose least, summed over the row buckets relative to the fastest kernel of any layout; each
    bucket then takes its fastest kernel on that layout."""
    def measure() -> dict:
        names = candidates(dtype, tuner.cpu)
        element = torch.empty((), dtype=dtype).element_size()
        weights = [(torch.rand(out_features, in_features) - 0.5).to(dtype)
                   for _ in range(copies_for(out_features * in_features * element))]
        stored = {layout: [store(w, layout) for w in weights] for layout in {KERNELS[n].layout for n in names}}
        ms: dict[str, list[float]] = {}
        for name in names:
            layout = KERNELS[name].layout
            ms[name] = []
            for rows in ROW_BUCKETS:
                x = (torch.rand(rows, in_features) - 0.5).to(dtype)
                # Few rows read the weight from memory (every copy); many rows are bound by arithmetic (two do).
                weights_now = stored[layout] if rows <= COLD_ROWS else stored[layout][:2]
                calls = [lambda w=w: run(name, x, w, in_features) for w in weights_now]
                ms[name].append(time_per_call(calls) * 1e3)
        best = [min(ms[n][i] for n in names) for i in range(len(ROW_BUCKETS))]

        def loss(layout: str) -> float:
            return sum(min(ms[n][i] for n in names if KERNELS[n].layout == layout) / best[i]
                       for i in range(len(ROW_BUCKETS)))

        layout = min(stored, key=loss)
        per_bucket = [min((n for n in names if KERNELS[n].layout == layout), key=lambda n: ms[n][i])
                      for i in range(len(ROW_BUCKETS))]
        plan = LinearPlan(layout, BucketPlan.from_buckets(per_bucket, ROW_BUCKETS))
        return {"layout": plan.layout, "kernels": plan.by_rows.to_json(), "rows": list(ROW_BUCKETS),
                "ms": {n: [round(t, 4) for t in v] for n, v in ms.items()}, "summary": plan.describe()}

    choice = tuner.choose(f"linear {str(dtype).removeprefix('torch.')} {out_features}x{in_features}", measure)
    return LinearPlan(choice["layout"], BucketPlan.from_json(choice["kernels"]))


def store(weight: torch.Tensor, layout: str) -> torch.Tensor:
    """weight [out, in] in `layout` (see the module docstring); the columns layout pads out to SPLIT groups."""
    if layout == "columns":
        out_features, in_features = weight.shape
        padded = -(-out_features // SPLIT) * SPLIT
        if padded != out_features:
            weight = torch.cat([weight, weight.new_zeros(padded - out_features, in_features)])
        return weight.t().contiguous()  # [in, padded out]
    if layout == "blocked":
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), BLOCKED_ROWS_HINT)
    return weight.contiguous()


def run(kernel: str, x: torch.Tensor, weight: torch.Tensor, in_features: int) -> torch.Tensor:
    """x [M, in] times a weight stored in the kernel's layout: [M, out] (columns: [M, padded out])."""
    if kernel == "linear":
        return F.linear(x, weight)
    if kernel in ("onednn", "onednn_packed"):
        return _onednn(x, weight)
    if kernel == "onednn_t":
        return _onednn(x, weight.t())
    if kernel == "widen":
        return _widened(x, weight)
    if kernel == "split":
        groups = weight.view(in_features, SPLIT, -1).permute(1, 0, 2)  # group g: columns [g * k, (g + 1) * k)
        rows = x.shape[0]
        out = torch.bmm(x.unsqueeze(0).expand(SPLIT, rows, in_features), groups)  # [SPLIT, M, k]
        # The width is spelled out: an empty x (an expert-parallel rank's share of no tokens) has no -1 to infer.
        return out.view(1, -1) if rows == 1 else out.permute(1, 0, 2).reshape(rows, weight.shape[1])
    raise ValueError(f"unknown kernel {kernel!r}; known: {', '.join(KERNELS)}")


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
                 device: torch.device, cpu: CpuFeatures | None = None, plan: LinearPlan | None = None):
        """plan: the layout and kernels (default: fixed_plan for this dtype, device and CPU; cpu: what this CPU
        runs, default this process's probe). `kernel` describes the plan."""
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else bias.to(device=device, dtype=dtype)
        self.plan = plan or fixed_plan(dtype, device, cpu)
        self.kernel = self.plan.describe()
        self.weight = store(weight.to(device=device, dtype=dtype), self.plan.layout)
        # The one-kernel plan (the common case on a GPU and for a single bucket) skips the lookup per call.
        kernels = self.plan.by_rows.names()
        self._only = kernels[0] if len(kernels) == 1 else None

    @property
    def nbytes(self) -> int:
        """Bytes read from memory per product (the weight and the bias)."""
        total = self.weight.numel() * self.weight.element_size()
        return total + (0 if self.bias is None else self.bias.numel() * self.bias.element_size())

    def dense_weight(self) -> torch.Tensor:
        """The weight as [out, in] in plain memory, whatever the layout (a copy unless the layout is rows)."""
        if self.plan.layout == "columns":
            return self.weight.t()[: self.out_features].contiguous()
        if self.plan.layout == "blocked":
            return self.weight.to_dense()
        return self.weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        kernel = self._only or self.plan.by_rows.kernel_for(x.shape[0])
        if kernel == "linear":
            return F.linear(x, self.weight, self.bias)
        out = run(kernel, x, self.weight, self.in_features)
        if out.shape[1] != self.out_features:
            out = out[:, : self.out_features]
        return out if self.bias is None else out + self.bias
