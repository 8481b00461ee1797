"""How a model's projections are held: the weight-format policy of engine/engine_config.py's WEIGHT_FORMATS,
applied as a rank's weights are read (ProjectionBuilder), and the reads themselves (read_weight: a lazily read
checkpoint tensor, only the rows and columns a rank holds, straight into its device and dtype).

dense: each projection in the compute dtype, in the layout `Linear` picks for the device (the tuner's kernel on
the CPU); packed: a GGUF file's Q4_0/Q4_1 projections kept 4-bit where the rank holds the whole projection, as
Q4_1 blocks on tandem's integer-dot kernels where the CPU probe says they run (engine/models/block_linear.py; an
LM head the file stores as Q8_0 then stays Q8_0 too), else on torch's int4 kernel, else expanded to bfloat16 with a
warning; int8 / int4 / int4_g128: every
projection quantized from its float32 values as it is read, the LM head to int8 either way (int4 falls back to
int8 where the CPU has no int4 kernel).
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch

from tandem.engine.engine_config import QUANTIZED_ON_LOAD, WEIGHT_FORMATS
from tandem.engine.hardware.cpu_features import FEATURES, CpuFeatures
from tandem.engine.hardware.kernel_tuning import KernelTuner
from tandem.engine.hardware.cpu_kernels import kernel_path
from tandem.engine.models.block_linear import BlockLinear
from tandem.engine.models.int4 import GROUPS as INT4_GROUPS
from tandem.engine.models.int4 import Int4Linear, Int4Weight
from tandem.engine.models.int8 import Int8Linear
from tandem.engine.models.linear import Linear, tuned_plan
from tandem.engine.models.mlp import GatedMLP
from tandem.engine.parallel.layout import split_evenly

_log = logging.getLogger(__name__)


class LazyWeight(Protocol):
    """A checkpoint tensor read on demand (engine/loader/lazy_tensor.py's LazyTensor; named here by what it
    offers, since models/ sits below loader/): its whole shape without reading data, and a read of some of its
    rows (dim 0) or columns (dim 1), None meaning all, as a new tensor of `dtype` on `device`."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    stored: str | None  # the file's type where a kernel may read it as stored ("Q8_0"), else None

    def read(self, rows: range | None = None, columns: range | None = None, *, dtype: torch.dtype,
             device: torch.device | str) -> torch.Tensor: ...


Weight = torch.Tensor | Int4Weight | LazyWeight


def read_weight(weight: Weight, rows: range | None = None, columns: range | None = None, *, dtype: torch.dtype,
                device: torch.device) -> torch.Tensor:
    """The rows and columns asked for (None: all) of a checkpoint value, as `dtype` on `device`. A LazyWeight
    reads only that slice from its file; an Int4Weight is expanded (float32) before it is sliced."""
    if not isinstance(weight, (torch.Tensor, Int4Weight)):
        return weight.read(rows, columns, dtype=dtype, device=device)
    if isinstance(weight, Int4Weight):
        weight = weight.dequantize()
    if rows is not None:
        weight = weight[rows.start:rows.stop]
    if columns is not None:
        weight = weight[:, columns.start:columns.stop]
    return weight.to(device=device, dtype=dtype)


def int4_group(weight_format: str, in_features: int) -> int:
    """The group size of an int4 projection: 128 for int4_g128 (32 for int4), or the largest smaller group of the
    kernel's that divides in_features (SmolLM2's 576 inputs take groups of 64 under int4_g128). Raises ValueError
    when none does."""
    wanted = 128 if weight_format == "int4_g128" else 32
    for group in sorted((g for g in INT4_GROUPS if g <= wanted), reverse=True):
        if in_features % group == 0:
            return group
    raise ValueError(f"int4 weights need in_features divisible by 32, got {in_features}")


Projection = Linear | Int4Linear | Int8Linear | BlockLinear


class ProjectionBuilder:
    """Builds one rank's projections from `weights` (a Hugging Face-named dict it consumes: each entry used is
    popped, to keep peak memory low) in the form the weight format asks for. tp, tp_index: the rank's tensor
    parallel group size and place (rows or columns of a projection split over it are read as asked). cpu: what
    the CPU runs (None off the CPU); tuner: the kernel timings to follow (None: the probe's fixed choices).
    Raises ValueError for an unknown weight format, a quantized or packed format with a dtype other than
    bfloat16, or int4 / packed weights off the CPU."""

    def __init__(self, weights: dict[str, Weight], *, dtype: torch.dtype, device: torch.device,
                 cpu: CpuFeatures | None, tuner: KernelTuner | None, weight_format: str, tp: int = 1,
                 tp_index: int = 0):
        self.weights, self.dtype, self.device, self.cpu, self.tuner = weights, dtype, device, cpu, tuner
        self.tp, self.tp_index = tp, tp_index
        if weight_format not in WEIGHT_FORMATS:
            raise ValueError(f"weights must be one of {', '.join(WEIGHT_FORMATS)}, got {weight_format!r}")
        quantize = weight_format if weight_format in QUANTIZED_ON_LOAD else None
        if quantize and dtype != torch.bfloat16:
            raise ValueError(f"{weight_format} weights compute in bfloat16, but dtype {dtype} was asked for")
        if quantize and quantize != "int8" and cpu is None:
            raise ValueError(f"{weight_format} weights run on the CPU only (torch's int4 CPU kernel); use int8 on "
                             f"{device.type}")
        if quantize and quantize != "int8" and not cpu.int4:
            _log.warning("%s weights: %s does not run here (%s); the projections are int8 instead", weight_format,
                         FEATURES["int4"], cpu.why_not.get("int4", "?"))
            quantize = "int8"
        self.quantize = quantize
        packed = [n for n, w in weights.items() if isinstance(w, Int4Weight)]
        if packed and dtype != torch.bfloat16:
            raise ValueError(f"packed 4-bit weights compute in bfloat16, but dtype {dtype} was asked for")
        if packed and cpu is None:
            raise ValueError("packed 4-bit weights run on the CPU only (torch's int4 CPU kernel)")
        # Packed weights on the integer-dot kernels (None: on torch's int4 kernel); an LM head stored as Q8_0 blocks
        # (a GGUF file's) stays Q8_0 on them too.
        self.int_dot = kernel_path(cpu) if packed else None
        self._q8_head = False
        self.keep_packed = bool(packed) and (cpu.int4 or self.int_dot is not None)
        if packed and not self.keep_packed:
            _log.warning("packed 4-bit weights: %s does not run here (%s), nor do %s (%s); they are expanded to "
                         "bfloat16, with 4x the weight memory", FEATURES["int4"], cpu.why_not.get("int4", "?"),
                         FEATURES["cpu_kernels"], cpu.why_not.get("cpu_kernels", "?"))

    def take(self, name: str) -> torch.Tensor:
        """A plain tensor (a norm, a router), whole, in the compute dtype."""
        return read_weight(self.weights.pop(name), dtype=self.dtype, device=self.device)

    def embedding(self, name: str) -> torch.Tensor:
        """The token embedding: float32 when the projections are quantized or the (tied) LM head stays Q8_0 (it is
        built from this), else in the compute dtype."""
        weight = self.weights.pop(name)
        self._q8_head = self.int_dot is not None and getattr(weight, "stored", None) == "Q8_0"
        return read_weight(weight, dtype=self._read_dtype(head=True), device=self.device)

    def _read_dtype(self, head: bool) -> torch.dtype:
        """The dtype a projection's weight is read in: float32 for what is quantized here (a Q8_0 head's blocks
        then hold the file's own values), else the compute dtype."""
        return torch.float32 if self.quantize or (head and self._q8_head) else self.dtype

    def linear(self, names: list[str], rows: list[range | None] | None = None, columns: range | None = None,
               head: bool = False, wide_input: bool = False) -> Projection:
        """One projection from the concatenated [out, in] weights of `names`: of each, only the output rows
        in `rows` (column parallel) or the input columns in `columns` (row parallel: the bias, a term of the
        sum, stays on TP rank 0 only) are read. head: the LM head (int8 when the weights are quantized).
        wide_input: its input has a few very large channels that leave little of int8's range to the rest of
        their block (QKV's, a layer's normed residual stream, and down's, SiLU(gate) * up): on the integer-dot
        kernels its activations are quantized to int16. Measured on the embedded model against float32 (KL at
        the last position, tests/engine/models/test_int4.py's prompts): int8 everywhere 0.035 on a 300-token
        prompt; int16 for QKV at most 0.013 under one torch capability and 0.022 under another (the same
        products, float rounding elsewhere tipping int8 codes of down's input); int16 for QKV and down at most
        0.0055 on six prompts and 0.0011-0.011 on the 300-token one under both (that prompt's last position is
        the most sensitive to rounding anywhere), for a few % of the step."""
        rows = rows or [None] * len(names)
        parts = [self.weights.pop(f"{n}.weight") for n in names]
        if head:
            self._q8_head = self.int_dot is not None and getattr(parts[0], "stored", None) == "Q8_0"
        biases = [(self.weights.pop(f"{n}.bias"), r) for n, r in zip(names, rows) if f"{n}.bias" in self.weights]
        bias = None
        if biases and (columns is None or self.tp_index == 0):
            bias = torch.cat([read_weight(b, r, dtype=self.dtype, device=self.device) for b, r in biases])
        whole = all(r is None for r in rows) and columns is None
        if (self.keep_packed and whole and all(isinstance(p, Int4Weight) for p in parts)
                and not (head and self.quantize)):
            weight = Int4Weight.cat(parts)
            if self.int_dot is not None and weight.group == BlockLinear.GROUP:
                return BlockLinear.q4_1(weight, bias, path=self.int_dot, wide=wide_input)
            return Int4Linear(weight, bias, device=self.device)
        weight = torch.cat([read_weight(p, r, columns, dtype=self._read_dtype(head), device=self.device)
                            for p, r in zip(parts, rows)])
        return self.dense(weight, bias, head)

    def dense(self, weight: torch.Tensor, bias: torch.Tensor | None, head: bool = False) -> Projection:
        """weight: in _read_dtype(head)."""
        if head and self._q8_head and not self.quantize:
            return BlockLinear.q8_0(weight, bias, path=self.int_dot)
        if self.quantize == "int8" or (self.quantize and head):
            return Int8Linear(weight, bias, dtype=self.dtype, device=self.device)
        if self.quantize:
            return Int4Linear(Int4Weight.quantize(weight, int4_group(self.quantize, weight.shape[1])), bias,
                              device=self.device)
        plan = None if self.tuner is None else tuned_plan(self.tuner, self.dtype, *weight.shape)
        return Linear(weight, bias, dtype=self.dtype, device=self.device, cpu=self.cpu, plan=plan)

    def mlp(self, names: tuple[str, str, str], size: int) -> GatedMLP:
        """A gated MLP (gate, up, down) of `size` columns, split over the rank's TP group."""
        split = None if self.tp == 1 else split_evenly(size, self.tp)[self.tp_index]
        return GatedMLP(self.linear(list(names[:2]), [split, split]),
                        self.linear([names[2]], columns=split, wide_input=True))
