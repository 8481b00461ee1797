"""Decode attention in one C++ call on the CPU (engine/hardware/csrc/decode_attention.cpp): for a decode-only step,
each sequence's new K and V go into its slot and its one query attends to its keys read in place through its block
table, without the gather of torch_ref.py's decode path (a copy of every visible key and value per layer) and with
one op instead of a dozen. The kernel is `paged` in torch_ref.DECODE_KERNELS; the backend takes it where the CPU
probe ran it (cpu_features: cpu_kernels) and the plan (fixed or tuned) chooses it for the batch's size.

A quantized cache, or a query of another dtype than the cache's float32 / bfloat16, takes the gather path."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.engine.attention.metadata import AttentionMetadata
from tandem.engine.hardware.cpu_kernels import library_error


def supports(q_dtype: torch.dtype, kv: torch.Tensor) -> bool:
    """Whether the kernel takes queries of q_dtype over a cache like kv (the caller checks the cache is not
    quantized)."""
    return library_error() is None and kv.is_contiguous() and kv.device.type == "cpu" and (
        (kv.dtype, q_dtype) in ((torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                (torch.bfloat16, torch.float32)))


def paged_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor, meta: AttentionMetadata,
                 scale: float, window: int | None, path: int = 0) -> torch.Tensor:
    """q [B, Hq, D], k and v [B, Hk, D] of a decode-only step's B sequences; kv one layer's cache [2, blocks, Hk,
    block_size, D], into which k and v are written at meta.slot_mapping. path: the kernels' path
    (engine/hardware/cpu_kernels.py PATHS; 0: the best here). Returns [B, Hq, D]."""
    return PagedStep.of(meta, scale, (window or 0,), path)(q, k.to(q.dtype), v.to(q.dtype), kv, 0)


@dataclass(frozen=True)
class PagedStep:
    """What every layer of one decode step passes the kernel besides its own q, k, v and cache, worked out once a
    step: the compiled step calls the kernel with it directly, without the backend's checks and Python per layer
    (TorchAttentionBackend.takes_paged decided it once for the step). windows: each layer's (0: none)."""

    slots: torch.Tensor
    tables: torch.Tensor
    lengths: torch.Tensor
    scale: float
    windows: tuple[int, ...]
    path: int

    @classmethod
    def of(cls, meta: AttentionMetadata, scale: float, windows: tuple[int, ...], path: int) -> PagedStep:
        return cls(meta.slot_mapping, meta.block_tables, meta.seq_lens_tensor, scale, windows, path)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor,
                 layer: int) -> torch.Tensor:
        """The kernel's result for `layer` (q, k, v of the query's dtype), [B, Hq, D]."""
        return torch.ops.tandem_cpu.paged_decode(q.contiguous(), k.contiguous(), v.contiguous(), kv, self.slots,
                                                 self.tables, self.lengths, self.scale, self.windows[layer],
                                                 self.path)
