"""The paged KV store itself."""

from __future__ import annotations

import torch

from tandem.engine.kv.kv_cache import KVCacheSpec, PagedKVCache


def test_a_new_store_holds_zeros_even_where_the_heap_held_nan():
    """Attention masks unwritten slots with zero weights, and 0 * NaN is NaN: a store must never start with
    whatever the allocator's previous user left (a small tensor full of NaN, freed just before, is the likely
    memory to be handed out again)."""
    spec = KVCacheSpec(2, 8, 16, 2, 16, torch.float32)
    for _ in range(10):
        leftover = torch.full((spec.bytes_per_block * spec.num_blocks // 4,), float("nan"))
        del leftover
        cache = PagedKVCache(spec)
        assert not torch.isnan(cache.data).any() and not cache.data.any()
        assert cache.data.shape == (2, 2, 8, 2, 16, 16)


def test_bfloat16_store_has_the_spec_size():
    spec = KVCacheSpec(3, 5, 16, 1, 8, torch.bfloat16)
    cache = PagedKVCache(spec)
    assert cache.data.dtype == torch.bfloat16
    assert cache.data.numel() * cache.data.element_size() == spec.bytes_per_block * spec.num_blocks
