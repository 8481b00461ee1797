"""What this CPU and this torch build can run, found once per process by trying it.

CPUs differ in ways a kernel choice must respect: oneDNN's bfloat16 inner product needs AVX-512 (or AVX2-VNNI-2) in
oneDNN's own dispatch and fails to build its primitive on an AVX2-only CPU; torch's packed int4 CPU kernel exists
only in some builds. Instead of deciding from flag names, the probe runs each kernel once on a tiny input and
checks the result against float32 math: a feature is present when it ran and was right.

The setting TANDEM_CPU_DISABLE (comma-separated feature names, read on the first call of `cpu_features()` in a
process; rank processes and Ray workers inherit it) turns probed features off, so a machine can take the paths of
a lesser CPU: `TANDEM_CPU_DISABLE=onednn_bf16` is what an AVX2 CPU gets. To make torch and oneDNN themselves
behave as on an AVX2 CPU, start the process with ATEN_CPU_CAPABILITY=avx2 and ONEDNN_MAX_CPU_ISA=AVX2.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

DISABLE_ENV = "TANDEM_CPU_DISABLE"
FEATURES = {
    "onednn": "oneDNN float32 linear",
    "onednn_bf16": "oneDNN bfloat16 inner product",
    "int4": "torch's packed int4 CPU kernel",
    "cpu_kernels": "tandem's C++ kernels (AVX2)",
    "cpu_kernels_avx512": "tandem's C++ kernels (AVX-512 VNNI)",
}
# The CPU flags that decide which kernels a CPU has (x86 names from /proc/cpuinfo; other machines report none).
_KERNEL_FLAGS = ("avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
                 "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CpuFeatures:
    """capability: torch's ATen CPU dispatch level (`torch.backends.cpu.get_cpu_capability()`: "AVX512", "AVX2",
    "DEFAULT", ...). flags: the kernel-relevant CPU flags. onednn / onednn_bf16 / int4: whether that kernel ran and
    gave the right answer (False also when disabled). cpu_kernels / cpu_kernels_avx512: tandem's own kernels
    (engine/hardware/cpu_kernels.py: the integer-dot products, the paged decode attention) on their AVX2 / AVX-512
    paths (the latter counts only with the former). why_not: feature -> the reason it is off (the kernel's own
    error, or the setting that disabled it)."""

    capability: str
    flags: tuple[str, ...]
    onednn: bool
    onednn_bf16: bool
    int4: bool
    cpu_kernels: bool = False
    cpu_kernels_avx512: bool = False
    why_not: dict[str, str] = field(default_factory=dict, compare=False)

    def without(self, names: list[str] | tuple[str, ...], reason: str) -> CpuFeatures:
        """A copy with `names` turned off, each for `reason`. Raises ValueError naming an unknown feature."""
        unknown = [n for n in names if n not in FEATURES]
        if unknown:
            raise ValueError(f"unknown CPU feature {unknown[0]!r}; known: {', '.join(FEATURES)}")
        why = dict(self.why_not) | {n: reason for n in names if getattr(self, n)}
        return replace(self, **{n: False for n in names}, why_not=why)

    def describe(self) -> str:
        """One line for logs and `tandem generate --verbose`."""
        flags = " ".join(self.flags) or "no x86 vector flags reported"
        parts = [f"CPU {self.capability} ({flags}), torch {torch.__version__}"]
        for name, title in FEATURES.items():
            parts.append(f"{title}: " + ("yes" if getattr(self, name) else f"no ({self.why_not.get(name, '?')})"))
        return "; ".join(parts)


def cpu_model() -> str:
    """The CPU's model name ("AMD EPYC", ...), from /proc/cpuinfo where there is one."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        import platform

        return platform.processor() or platform.machine() or "unknown CPU"


def _cpu_flags() -> tuple[str, ...]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    present = set(line.partition(":")[2].split())
    return tuple(f for f in _KERNEL_FLAGS if f in present)


def _first_sentence(error: BaseException) -> str:
    """The error's first sentence (oneDNN appends advice on how to debug it)."""
    first = str(error).strip().split("\n")[0].split(". ")[0].rstrip(".")
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


def _try(run) -> str | None:
    """None if run() returned True; otherwise why not (its error, or that its answer was wrong)."""
    try:
        return None if run() else "ran but gave a wrong answer"
    except Exception as e:  # noqa: BLE001 - any failure of a kernel means "not on this CPU"
        return _first_sentence(e)


def _close(out: torch.Tensor, expected: torch.Tensor) -> bool:
    return out.shape == expected.shape and bool(((out.float() - expected).abs() <= 0.05 * expected.abs().max()).all())


def _onednn_linear(dtype: torch.dtype):
    def run() -> bool:
        if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
            raise RuntimeError("this torch build has no oneDNN linear")
        g = torch.Generator().manual_seed(0)
        x, w = torch.randn(3, 64, generator=g), torch.randn(48, 64, generator=g)
        x, w = x.to(dtype), w.to(dtype)
        out = torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
        return _close(out, x.float() @ w.float().t())
    return run


def _int4() -> bool:
    ops = torch.ops.aten
    if not hasattr(ops, "_weight_int4pack_mm_for_cpu"):
        raise RuntimeError("this torch build has no _weight_int4pack_mm_for_cpu")
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (16, 64), dtype=torch.int32, generator=g)
    scale, zero = torch.rand(16, 2, generator=g) + 0.5, torch.rand(16, 2, generator=g)
    x = torch.randn(2, 64, generator=g).to(torch.bfloat16)
    packed = ops._convert_weight_to_int4pack_for_cpu(codes, 1)
    scales_zeros = torch.stack([scale.t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous()
    out = ops._weight_int4pack_mm_for_cpu(x, packed, 32, scales_zeros)
    s, z = scales_zeros[..., 0].float().t(), scales_zeros[..., 1].float().t()  # [16, 2] as the kernel reads them
    weight = (codes - 8).float() * s.repeat_interleave(32, dim=1) + z.repeat_interleave(32, dim=1)
    return _close(out, x.float() @ weight.t())


def _cpu_kernels(path: str):
    """tandem's C++ kernels on `path` (engine/hardware/cpu_kernels.py PATHS): the Q4_1 and Q8_0 integer-dot
    products against float32 math on the weights their blocks hold, and the paged decode attention over two
    sequences' blocks out of order against softmax attention."""
    def run() -> bool:
        from tandem.engine.hardware import int_dot
        from tandem.engine.hardware.cpu_kernels import PATHS, library_error, supported_paths

        if (error := library_error()) is not None:
            raise RuntimeError(error)
        if path not in supported_paths():
            raise RuntimeError(f"this CPU has no {path} (the library's paths here: {', '.join(supported_paths())})")
        number = PATHS[path]
        g = torch.Generator().manual_seed(0)
        codes = torch.randint(0, 16, (48, 96), dtype=torch.uint8, generator=g)
        scale, offset = torch.rand(48, 3, generator=g) / 8 + 0.01, torch.rand(48, 3, generator=g) - 0.5
        x = torch.randn(3, 96, generator=g)
        weight = codes.float() * scale.half().float().repeat_interleave(32, 1) + \
            offset.half().float().repeat_interleave(32, 1)
        dense = torch.randn(40, 96, generator=g)
        return (_close(int_dot.q4_1_linear(x, int_dot.q4_1_blocks(codes, scale, offset), 48, number), x @ weight.t())
                and _close(int_dot.q8_0_linear(x, int_dot.q8_0_blocks(dense), 40, number), x @ dense.t())
                and _decode_attention(number))
    return run


def _decode_attention(path: int) -> bool:
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(2, 6, 2, 4, 16, generator=g)  # [K|V, blocks, KV heads, block size, D]
    tables, lengths = torch.tensor([[4, 1, 0], [2, 5, 3]]), torch.tensor([7, 10])
    q, k = torch.randn(2, 4, 16, generator=g), torch.randn(2, 2, 16, generator=g)
    slots = torch.stack([tables[i, (n - 1) // 4] * 4 + (n - 1) % 4 for i, n in enumerate(lengths.tolist())])
    out = torch.ops.tandem_cpu.paged_decode(q, k, k, kv, slots, tables, lengths, 0.25, 0, path)
    expected = []
    for i, n in enumerate(lengths.tolist()):
        keys = kv[0][tables[i]].transpose(0, 1).reshape(2, -1, 16)[:, :n]  # [KV heads, n, D], the new one written
        values = kv[1][tables[i]].transpose(0, 1).reshape(2, -1, 16)[:, :n]
        weights = torch.softmax(q[i].view(2, 2, 16) @ keys.transpose(1, 2) * 0.25, dim=-1)
        expected.append((weights @ values).reshape(4, 16))
    return _close(out, torch.stack(expected))


def probe() -> CpuFeatures:
    """Runs every kernel once on a tiny input (milliseconds). Uncached: use `cpu_features()`."""
    why = {"onednn": _try(_onednn_linear(torch.float32)), "onednn_bf16": _try(_onednn_linear(torch.bfloat16)),
           "int4": _try(_int4), "cpu_kernels": _try(_cpu_kernels("avx2")),
           "cpu_kernels_avx512": _try(_cpu_kernels("avx512_vnni"))}
    return CpuFeatures(capability=torch.backends.cpu.get_cpu_capability(), flags=_cpu_flags(),
                       **{name: reason is None for name, reason in why.items()},
                       why_not={name: reason for name, reason in why.items() if reason is not None})


def _disabled_by_setting(value: str) -> list[str]:
    """The feature names in a TANDEM_CPU_DISABLE value ("" -> none)."""
    return [name.strip() for name in value.split(",") if name.strip()]


@functools.cache
def cpu_features() -> CpuFeatures:
    """This process's answer: the probe, less what TANDEM_CPU_DISABLE turns off. Logged once. Raises ValueError
    if the setting names an unknown feature."""
    features = probe()
    disabled = _disabled_by_setting(os.environ.get(DISABLE_ENV, ""))
    if disabled:
        features = features.without(disabled, f"{DISABLE_ENV}={os.environ[DISABLE_ENV]}")
    _log.info("%s", features.describe())
    return features
