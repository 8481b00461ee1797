"""Attention over a paged KV store: metadata shared by all backends and the torch reference backend."""

from tandem.engine.attention.metadata import AttentionMetadata
from tandem.engine.attention.torch_ref import TorchAttentionBackend

__all__ = ["AttentionMetadata", "TorchAttentionBackend"]
