"""The Triton attention backend: the same interface as TorchAttentionBackend (write_kv, forward), with decode-only
batches on the split-K paged decode kernel (triton_decode.py) and every other batch (prefill chunks, with any
decodes mixed in as one-token chunks) on the paged prefill kernel (triton_prefill.py). Both read K/V straight
from the engine's paged cache through the block tables; the new tokens' K/V are scattered into it first, as the
reference does."""

from __future__ import annotations

import torch

from tandem.engine.attention.metadata import AttentionMetadata
from tandem.engine.engine_config import ATTENTION_BACKENDS
from tandem.engine.attention.torch_ref import TorchAttentionBackend


class TritonAttentionBackend(TorchAttentionBackend):
    """Stateless; one instance serves every layer. Importing it imports Triton (see select_backend)."""

    def __init__(self):
        from tandem.engine.attention import triton_decode, triton_norm, triton_prefill

        self._decode_kernel = triton_decode.paged_decode_attention
        self._prefill_kernel = triton_prefill.paged_prefill_attention
        self.fused = triton_norm  # rms_norm (with the residual add) and rotary_, used by the model

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor,
                meta: AttentionMetadata, scale: float, window: int | None = None) -> torch.Tensor:
        self.write_kv(k, v, kv, meta)
        if meta.is_decode_only:
            out = self._decode_kernel(q, kv, meta.block_tables, meta.seq_lens_tensor, scale, window)
        else:
            starts = meta.per_step("query_start_loc", lambda: torch.tensor(meta.query_start_loc, device=q.device))
            max_query = max(b - a for a, b in zip(meta.query_start_loc, meta.query_start_loc[1:]))
            out = self._prefill_kernel(q, kv, meta.block_tables, starts, meta.seq_lens_tensor, max_query, scale,
                                       window)
        return out.reshape(q.shape[0], -1)


def select_backend(name: str, device: torch.device) -> TorchAttentionBackend:
    """name: "torch" (the reference), "triton", or "auto" (Triton on CUDA when Triton is installed, the torch
    reference otherwise). Raises ValueError for an unknown name or "triton" without Triton installed."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {name!r}")
    if name == "torch" or (name == "auto" and device.type != "cuda"):
        return TorchAttentionBackend()
    try:
        return TritonAttentionBackend()
    except ImportError as e:
        if name == "auto":
            return TorchAttentionBackend()
        raise ValueError(f"the triton attention backend needs the triton package ({e})") from None
