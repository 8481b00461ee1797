"""Runs the model over a batch of sequence chunks: builds input tensors and attention metadata, returns logits.

The runner owns no policy: which tokens to compute and which KV blocks hold them arrive in SequenceChunk
objects (the scheduler's decisions), so the same runner serves single-request generation and batching.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from tandem.engine.attention import AttentionMetadata
from tandem.engine.kv_cache import PagedKVCache
from tandem.engine.models import LlamaModel


@dataclass(frozen=True)
class SequenceChunk:
    """token_ids: the tokens to compute now, at positions num_computed_tokens onwards.
    block_ids: the sequence's whole block table; it must cover num_computed_tokens + len(token_ids)."""

    token_ids: tuple[int, ...]
    num_computed_tokens: int
    block_ids: tuple[int, ...]


class ModelRunner:
    def __init__(self, model: LlamaModel, kv_cache: PagedKVCache):
        self.model = model
        self.kv_cache = kv_cache
        self.device = model.device

    def execute(self, chunks: Sequence[SequenceChunk]) -> torch.Tensor:
        """Computes every chunk, writing its K/V to the cache. Returns float32 logits [len(chunks), vocab] of
        each chunk's last token. Raises ValueError if a block table is too short."""
        ids = [t for c in chunks for t in c.token_ids]
        positions = [p for c in chunks for p in range(c.num_computed_tokens, c.num_computed_tokens + len(c.token_ids))]
        meta = AttentionMetadata.build(
            query_lens=[len(c.token_ids) for c in chunks],
            num_computed=[c.num_computed_tokens for c in chunks],
            block_tables=[c.block_ids for c in chunks],
            block_size=self.kv_cache.spec.block_size,
            device=self.device,
        )
        hidden = self.model.forward(
            torch.tensor(ids, dtype=torch.int64, device=self.device),
            torch.tensor(positions, dtype=torch.int64, device=self.device),
            meta,
            self.kv_cache,
        )
        last = torch.tensor(meta.query_start_loc[1:], device=self.device) - 1
        return self.model.compute_logits(hidden[last])
