"""Attention over a paged KV store: metadata shared by all backends, the torch reference backend, and (imported
only when chosen, see triton_backend.select_backend) the Triton kernels: triton_decode.py (split-K paged decode),
triton_prefill.py (paged prefill over cached context), triton_norm.py (fused RMSNorm with residual, rotary)."""

from tandem.engine.attention.metadata import AttentionMetadata
from tandem.engine.attention.torch_ref import TorchAttentionBackend

__all__ = ["AttentionMetadata", "TorchAttentionBackend"]
