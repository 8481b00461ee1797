"""tandem's CPU kernels, engine/hardware/csrc/ built at install (setup.py) as the extension
tandem.engine.hardware._cpu_kernels: importing it registers torch ops under tandem_cpu:: (the integer-dot products of
engine/hardware/int_dot.py, the paged decode attention of engine/attention/cpu_decode.py). This module loads it once
and tells why not when it cannot; the CPU probe (cpu_features.py) runs each kernel before anything uses it."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tandem.engine.hardware.cpu_features import CpuFeatures

# The instruction-set path every tandem_cpu op takes as its last argument (csrc/paths.h; 0: the best this CPU has).
PATHS = {"scalar": 1, "avx2": 2, "avx512_vnni": 3}


@functools.cache
def library_error() -> str | None:
    """None once the extension is loaded (its ops registered), else why it is not: not built at install, or not
    loadable by this torch."""
    try:
        import tandem.engine.hardware._cpu_kernels  # noqa: F401 - loading it registers the tandem_cpu ops
    except ImportError as e:
        return f"the extension tandem.engine.hardware._cpu_kernels is not built or not loadable ({e})"
    torch.library.register_fake("tandem_cpu::q4_1_linear", _product_like)
    torch.library.register_fake("tandem_cpu::q4_1_linear_wide", _product_like)
    torch.library.register_fake("tandem_cpu::q8_0_linear", _product_like)
    torch.library.register_fake("tandem_cpu::paged_decode", _decode_like)
    torch.library.register_fake("tandem_cpu::block_project", _held_product_like)
    return None


def kernel_path(cpu: CpuFeatures | None) -> int | None:
    """The path the CPU probe chose for this process (AVX-512 VNNI over AVX2; TANDEM_CPU_DISABLE may take either
    away), or None where the kernels do not run here."""
    if cpu is None or not cpu.cpu_kernels:
        return None
    return PATHS["avx512_vnni"] if cpu.cpu_kernels_avx512 else PATHS["avx2"]


def supported_paths() -> list[str]:
    """The paths this CPU runs, best last (empty: the library is not loaded)."""
    if library_error() is not None:
        return []
    mask = torch.ops.tandem_cpu.supported_paths()
    return [name for name, bit in PATHS.items() if mask & (1 << bit)]


def _product_like(x: torch.Tensor, blocks: torch.Tensor, n: int, path: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], n)


def _held_product_like(x: torch.Tensor, handle: int, n: int, path: int, kind: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], n)


def _decode_like(q, k, v, kv, slots, block_tables, seq_lens, scale, window, path) -> torch.Tensor:
    return torch.empty_like(q)
