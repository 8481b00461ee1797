"""Perplexity of a loaded model over a text, computed the way serving computes it: the text is fed in prefill
chunks through a paged KV cache of a given dtype, so every chunk after the first attends to the K/V earlier chunks
stored (quantized, when the cache is). Used by the accuracy gate of the quantized modes (tests) and by
bench/quantization.py."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tandem.engine.attention.metadata import AttentionMetadata
from tandem.engine.kv.kv_cache import KVCacheSpec, PagedKVCache
from tandem.engine.models import LlamaModel

DEFAULT_CHUNK = 128  # tokens per prefill chunk: small enough that most attention reads the stored K/V


@dataclass(frozen=True)
class Perplexity:
    value: float  # exp(mean negative log-likelihood of each token given the ones before it)
    num_tokens: int  # tokens scored (the text's length minus one)

    def ratio(self, baseline: Perplexity) -> float:
        return self.value / baseline.value


def perplexity(model: LlamaModel, token_ids: list[int], kv_dtype: torch.dtype, *, block_size: int = 16,
               chunk: int = DEFAULT_CHUNK) -> Perplexity:
    """Scores token_ids with `model` (a whole model in this process) over a fresh KV cache storing `kv_dtype`.
    Raises ValueError for fewer than two tokens."""
    if len(token_ids) < 2:
        raise ValueError("perplexity needs at least two tokens")
    c, device = model.config, model.device
    num_blocks = -(-len(token_ids) // block_size)
    cache = PagedKVCache(KVCacheSpec(c.num_layers, num_blocks, block_size, model.num_kv_heads, c.head_dim, kv_dtype),
                         device)
    table = list(range(num_blocks))
    ids = torch.tensor(token_ids, dtype=torch.int64, device=device)
    nll = 0.0
    with torch.inference_mode():
        for start in range(0, len(token_ids) - 1, chunk):
            end = min(start + chunk, len(token_ids) - 1)  # the last token is only a target
            meta = AttentionMetadata.build([end - start], [start], [table], block_size, device)
            positions = torch.arange(start, end, device=device)
            hidden = model.forward(ids[start:end], positions, meta, cache)
            logits = model.compute_logits(hidden).float()
            nll += torch.nn.functional.cross_entropy(logits, ids[start + 1:end + 1], reduction="sum").item()
    count = len(token_ids) - 1
    return Perplexity(math.exp(nll / count), count)
