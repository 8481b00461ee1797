"""The host tier's storage (engine/kv/host_blocks.py): blocks saved from the device store and loaded back are the
same bytes in every layer, K and V, a quantized store's scale rows included; a slot's bytes go to the disk tier's
file and come back; each block's layers sit together in one run."""

from __future__ import annotations

import pytest
import torch

from tandem.engine.kv.disk_blocks import read_block, write_block
from tandem.engine.kv.host_blocks import HostBlockStore
from tandem.engine.kv.kv_cache import KVCacheSpec, PagedKVCache


def _filled(dtype: torch.dtype, num_blocks: int = 12) -> PagedKVCache:
    spec = KVCacheSpec(num_layers=3, num_blocks=num_blocks, block_size=4, num_kv_heads=2, head_dim=8, dtype=dtype)
    cache = PagedKVCache(spec)
    raw = cache.data.view(torch.uint8)
    raw.copy_(torch.randint(0, 120, raw.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(1)))
    return cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.float8_e4m3fn],
                         ids=["float32", "bfloat16", "int8", "fp8"])
@pytest.mark.parametrize("slots", [[0, 1, 2], [5, 0, 3]], ids=["contiguous-slots", "scattered-slots"])
def test_blocks_go_down_and_come_back_byte_for_byte(dtype, slots):
    cache = _filled(dtype)
    host = HostBlockStore(cache.spec, 6)
    before = cache.data.view(torch.uint8).clone()
    host.save(cache, [7, 2, 9], slots)
    for block, slot in zip([7, 2, 9], slots):  # one contiguous run per block: all its layers, K and V
        assert torch.equal(host.data[slot].view(torch.uint8), before[:, :, block].view(torch.uint8))
        assert len(host.payload(slot)) == cache.spec.bytes_per_block
    host.load(cache, slots, [0, 1, 11])
    after = cache.data.view(torch.uint8)
    for src, dst in zip([7, 2, 9], [0, 1, 11]):
        assert torch.equal(after[:, :, dst], before[:, :, src])
    untouched = [b for b in range(12) if b not in (0, 1, 11)]
    assert torch.equal(after[:, :, untouched], before[:, :, untouched])


def test_a_slot_round_trips_through_the_disk_tier(tmp_path):
    cache = _filled(torch.bfloat16)
    host = HostBlockStore(cache.spec, 2)
    host.save(cache, [4], [0])
    write_block(tmp_path, 0x44, host.payload(0))
    found = read_block(tmp_path, 0x44, cache.spec.bytes_per_block)
    host.fill(1, found.payload)
    assert torch.equal(host.data[1].view(torch.uint8), host.data[0].view(torch.uint8))
    with pytest.raises(ValueError, match="bytes, not"):
        host.fill(1, found.payload[:-2])


def test_another_stores_blocks_are_refused():
    cache = _filled(torch.float32)
    other = KVCacheSpec(num_layers=3, num_blocks=1, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="not this tier's"):
        HostBlockStore(other, 2).save(cache, [1], [0])
    with pytest.raises(ValueError, match="2 blocks for 1 slots"):
        HostBlockStore(cache.spec, 2).save(cache, [1, 2], [0])
