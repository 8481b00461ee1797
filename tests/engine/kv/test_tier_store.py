"""One rank's tier storage (engine/kv/tier_store.py) running a step's tier copies: in order, the synchronous part
before start() returns, disk blocks checked on the way up, a load's run cut at the first block whose fetch failed,
failed writes reported; on a GPU the same copies through pinned memory and a side stream."""

from __future__ import annotations

import errno

import pytest
import torch

from tandem.engine.kv import tier_store
from tandem.engine.kv.disk_blocks import DiskTierError, block_path
from tandem.engine.kv.kv_cache import KVCacheSpec, PagedKVCache
from tandem.engine.kv.tier_store import TierStore
from tandem.engine.scheduler_output import (DropBlock, FetchBlock, LoadBlocks, SaveBlocks, SpillBlock, TierOps,
                                            TierReport)


def filled_cache(device: str = "cpu", dtype: torch.dtype = torch.bfloat16) -> PagedKVCache:
    spec = KVCacheSpec(num_layers=2, num_blocks=10, block_size=4, num_kv_heads=2, head_dim=8, dtype=dtype)
    cache = PagedKVCache(spec, device)
    raw = cache.data.view(torch.uint8)
    raw.copy_(torch.randint(0, 120, raw.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(3)))
    return cache


def block(cache: PagedKVCache, b: int) -> torch.Tensor:
    return cache.data.view(torch.uint8)[:, :, b].cpu().clone()


def test_blocks_go_down_to_disk_and_come_back_to_other_blocks(tmp_path):
    cache = filled_cache()
    store = TierStore(cache, host_slots=2, disk_folder=tmp_path / "rank0")
    originals = {b: block(cache, b) for b in (1, 2, 3)}
    store.start(TierOps((SaveBlocks((1, 2), (0, 1)), SpillBlock(0, 0xA), SaveBlocks((3,), (0,)),
                         SpillBlock(1, 0xB))))
    assert store.wait() == TierReport()  # nothing failed, nothing came up
    store.start(TierOps((FetchBlock(0xA, 1), LoadBlocks((1, 0), (7, 8), (0xA, 0xC)))))
    report = store.wait()
    assert report.failed == ()
    assert [(tier, blocks) for tier, blocks, _ in report.times] == [("disk", 1), ("host", 2)]  # each copy up, timed
    assert all(seconds > 0 for _, _, seconds in report.times)
    assert torch.equal(block(cache, 7), originals[1]) and torch.equal(block(cache, 8), originals[3])
    store.start(TierOps((DropBlock(0xB),)))
    store.wait()
    assert not block_path(tmp_path / "rank0", 0xB).exists()
    store.close()
    assert not (tmp_path / "rank0").exists()


@pytest.mark.parametrize("damage", ["corrupt", "missing"])
def test_a_failed_fetch_is_reported_and_its_run_stops_there(tmp_path, damage):
    cache = filled_cache()
    store = TierStore(cache, host_slots=3, disk_folder=tmp_path)
    store.start(TierOps((SaveBlocks((1, 2), (0, 1)), SpillBlock(0, 0xA), SpillBlock(1, 0xB))))
    store.wait()
    path = block_path(tmp_path, 0xB)
    if damage == "missing":
        path.unlink()
    else:
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
    before = block(cache, 6), block(cache, 7)
    store.start(TierOps((FetchBlock(0xA, 2), FetchBlock(0xB, 0), LoadBlocks((2, 0), (5, 6), (0xA, 0xB)))))
    report = store.wait()
    assert report.failed == ((0xB, damage),)
    assert [(tier, blocks) for tier, blocks, _ in report.times] == [("disk", 1), ("host", 1)]  # the run stopped
    assert torch.equal(block(cache, 5), block(cache, 1))  # the run up to the failed block is loaded
    assert torch.equal(block(cache, 6), before[0]) and torch.equal(block(cache, 7), before[1])  # nothing after it
    store.close()


def test_a_failed_write_is_reported_with_its_reason(tmp_path, monkeypatch):
    def full(folder, block_hash, payload):
        raise DiskTierError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(tier_store, "write_block", full)
    store = TierStore(filled_cache(), host_slots=1, disk_folder=tmp_path)
    store.start(TierOps((SaveBlocks((1,), (0,)), SpillBlock(0, 0xA))))
    assert store.wait().failed == ((0xA, "write failed: No space left on device"),)
    store.close()


def test_the_synchronous_part_is_done_before_start_returns(tmp_path):
    cache = filled_cache()
    store = TierStore(cache, host_slots=2)
    original = block(cache, 4)
    store.start(TierOps((SaveBlocks((4,), (0,)), SaveBlocks((5,), (1,))), sync=1))
    cache.data.view(torch.uint8)[:, :, 4] = 0  # the step writes block 4 now: its save already read it
    store.wait()
    assert torch.equal(store.host.data[0].view(torch.uint8), original)
    store.start(TierOps((SpillBlock(0, 0xA),)))  # a store without a folder reports a disk copy, never drops it
    assert store.wait().failed == ((0xA, "no disk tier"),)
    store.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (pinned host slots, a side stream)")
def test_gpu_blocks_round_trip_through_pinned_slots_and_disk(tmp_path):
    cache = filled_cache("cuda")
    store = TierStore(cache, host_slots=2, disk_folder=tmp_path)
    assert store.host.data.is_pinned()
    original = block(cache, 3)
    store.start(TierOps((SaveBlocks((3,), (0,)), SpillBlock(0, 0xA))))
    assert store.wait() == TierReport()
    store.start(TierOps((FetchBlock(0xA, 1), LoadBlocks((1,), (9,), (0xA,)))))
    assert store.wait().failed == ()
    assert torch.equal(block(cache, 9), original)
    store.close()
