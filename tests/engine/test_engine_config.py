from __future__ import annotations

import pytest

from tandem.engine.engine_config import EngineConfig

BLOCK = 1 << 20  # bytes in one block, all layers


def test_kv_budget_in_blocks_bytes_or_a_fraction_of_free_memory():
    assert EngineConfig(num_kv_blocks=7).num_blocks(BLOCK, free_bytes=0, on_gpu=False) == 7
    assert EngineConfig(kv_cache_bytes=10 * BLOCK + 5).num_blocks(BLOCK, free_bytes=0, on_gpu=False) == 10
    assert EngineConfig(kv_cache_fraction=0.5).num_blocks(BLOCK, free_bytes=64 * BLOCK, on_gpu=False) == 32
    assert EngineConfig().num_blocks(BLOCK, free_bytes=100 * BLOCK, on_gpu=False) == 25  # CPU default 0.25
    assert EngineConfig().num_blocks(BLOCK, free_bytes=100 * BLOCK, on_gpu=True) == 90  # GPU default 0.9


@pytest.mark.parametrize("kwargs, message", [
    ({"num_kv_blocks": 4, "kv_cache_bytes": 100}, "one KV budget, not num_kv_blocks and kv_cache_bytes"),
    ({"kv_cache_fraction": 1.5}, r"kv_cache_fraction must be in \(0, 1\]"),
    ({"block_size": 12}, "power of two"),
    ({"num_kv_blocks": 0}, "at least 1"),
])
def test_bad_settings_are_rejected_with_the_field_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


def test_a_budget_below_one_block_is_an_error():
    with pytest.raises(ValueError, match="holds no block"):
        EngineConfig(kv_cache_bytes=BLOCK - 1).num_blocks(BLOCK, free_bytes=0, on_gpu=False)
