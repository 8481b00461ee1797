"""What a benchmark ran on, for its JSON: the CPU model, cores, torch, and what the CPU probe found (capability,
kernel-relevant flags, which kernels run), so that results from an AVX2 and an AVX-512 machine are never mixed up."""

from __future__ import annotations

import os
import platform

import torch

from tandem.engine.hardware.cpu_features import cpu_model


def machine_line() -> str:
    """One line: CPU model, architecture, cores, torch version and torch's CPU capability."""
    return (f"{cpu_model()}, {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
            f"{torch.backends.cpu.get_cpu_capability()}")


def cpu_report() -> dict:
    """The probe of this process (with TANDEM_CPU_DISABLE applied) as JSON-ready values."""
    from tandem.engine.hardware.cpu_features import FEATURES, cpu_features

    found = cpu_features()
    return {"capability": found.capability, "flags": list(found.flags),
            "kernels": {name: getattr(found, name) for name in FEATURES}, "why_not": found.why_not,
            "env": {k: os.environ[k] for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "TANDEM_CPU_DISABLE")
                    if k in os.environ}}


def embedded_on(device: str):
    """The embedded model on `device` in that device's default dtype (float32 on the CPU, bfloat16 on CUDA), and
    the dtype's name: what the engine benchmarks that take --device run."""
    from tandem.engine.hardware.device import default_dtype
    from tandem.engine.loader import load_model

    dtype = default_dtype(device)
    return load_model(progress=False, dtype=getattr(torch, dtype), device=device), dtype
