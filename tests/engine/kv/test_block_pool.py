from __future__ import annotations

import random

import pytest

from tandem.engine.kv.block_pool import BlockPool, OutOfBlocksError


def test_random_allocate_share_release_keeps_integrity():
    pool = BlockPool(32)
    rng = random.Random(0)
    owners: list[int] = []  # one entry per owner of a block
    for _ in range(1000):
        action = rng.random()
        if owners and action < 0.4:
            block = owners.pop(rng.randrange(len(owners)))
            pool.decref(block, park=rng.random() < 0.5)
        elif owners and action < 0.55:
            block = rng.choice(owners)
            pool.incref(block)
            owners.append(block)
        elif pool.num_parked and action < 0.65:
            pool.evict(rng.randint(1, pool.num_parked))
        else:
            n = rng.randint(1, 4)
            if n <= pool.num_free:
                owners.extend(pool.allocate(n))
            else:
                with pytest.raises(OutOfBlocksError):
                    pool.allocate(n)
        pool.check_integrity()
        assert {b: owners.count(b) for b in owners} == {b: pool.ref_count(b) for b in pool.blocks_in_use()}


def test_failed_allocation_takes_nothing_and_leaves_parked_blocks_alone():
    pool = BlockPool(4)
    held = pool.allocate(3)
    pool.decref(held[0], park=True)
    with pytest.raises(OutOfBlocksError, match="asked for 2 KV blocks, 1 free of 4"):
        pool.allocate(2)
    assert (pool.num_free, pool.num_parked, pool.num_in_use) == (1, 1, 2)


def test_parked_blocks_are_evicted_oldest_first_and_can_be_revived():
    pool = BlockPool(4)
    a, b, c, d = pool.allocate(4)
    for block in (c, a, d):
        pool.decref(block, park=True)
    pool.incref(a)  # a cache hit takes a back into use
    assert pool.ref_count(a) == 1 and not pool.is_parked(a)
    assert pool.evict(1) == [c]
    assert pool.evict(1) == [d]
    with pytest.raises(ValueError, match="only 0 are parked"):
        pool.evict(1)
    pool.check_integrity()


def test_shared_block_is_freed_only_by_its_last_owner():
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.incref(block)
    assert pool.decref(block, park=False) == 1 and pool.num_free == 1
    assert pool.decref(block, park=False) == 0 and pool.num_free == 2


def test_misuse_is_an_error():
    pool = BlockPool(4)
    (block,) = pool.allocate(1)
    pool.decref(block, park=False)
    with pytest.raises(ValueError, match="not in use"):
        pool.decref(block, park=False)
    with pytest.raises(ValueError, match="is free"):
        pool.incref(block)
    with pytest.raises(ValueError, match="at least one block"):
        BlockPool(0)
    pool.check_integrity()


def test_check_integrity_catches_corruption():
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    pool._free.append(blocks[0])  # a block both free and in use
    with pytest.raises(ValueError, match="both free and in use"):
        pool.check_integrity()
