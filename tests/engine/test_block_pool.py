from __future__ import annotations

import random

import pytest

from tandem.engine.block_pool import BlockPool, OutOfBlocksError


def test_allocate_free_roundtrip_keeps_integrity():
    pool = BlockPool(32)
    rng = random.Random(0)
    held: list[list[int]] = []
    for _ in range(500):
        if held and rng.random() < 0.5:
            pool.free(held.pop(rng.randrange(len(held))))
        else:
            n = rng.randint(1, 6)
            if n <= pool.num_free:
                held.append(pool.allocate(n))
            else:
                with pytest.raises(OutOfBlocksError):
                    pool.allocate(n)
        pool.check_integrity()
        assert pool.num_free + sum(map(len, held)) == 32
        assert len({b for h in held for b in h}) == sum(map(len, held))


def test_failed_allocation_takes_nothing():
    pool = BlockPool(4)
    pool.allocate(3)
    with pytest.raises(OutOfBlocksError, match="asked for 2 KV blocks, 1 free of 4"):
        pool.allocate(2)
    assert pool.num_free == 1


def test_double_free_is_an_error():
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    pool.free(blocks)
    with pytest.raises(ValueError, match="not in use"):
        pool.free(blocks[:1])
    pool.check_integrity()
