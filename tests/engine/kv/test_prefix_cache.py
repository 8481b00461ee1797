from __future__ import annotations

import pytest

from tandem.engine.kv.kv_events import BlockRemoved, BlockStored, KVEventRecorder
from tandem.engine.kv.prefix_cache import PrefixCache, block_hashes, extend_block_hashes, hash_block_tokens


def test_hash_chains_cover_the_whole_prefix_and_the_salt():
    a = block_hashes(list(range(8)), 4)
    b = block_hashes([99, 1, 2, 3, 4, 5, 6, 7], 4)
    assert len(a) == 2 and a[0] != b[0]
    assert a[1] != b[1]  # same tokens in block 2, different parent
    assert block_hashes(list(range(8)), 4) == a  # deterministic
    assert block_hashes(list(range(8)), 4, cache_salt="tenant-a") != a
    assert block_hashes(list(range(8)), 4, "tenant-a") != block_hashes(list(range(8)), 4, "tenant-b")
    assert block_hashes(list(range(7)), 4) == a[:1]  # partial blocks are not hashed


def test_hash_is_stable_across_processes():
    # A router in another process must compute the same hash; pin one value so a change is deliberate.
    assert hash_block_tokens(None, [1, 2, 3, 4]) == hash_block_tokens(None, (1, 2, 3, 4))
    assert hash_block_tokens(None, [1, 2, 3, 4]) == 0x9222804E3E39BA2


def test_extend_adds_only_new_full_blocks():
    tokens = list(range(10))
    hashes = block_hashes(tokens[:5], 4)
    extend_block_hashes(hashes, tokens, 4, None)
    assert hashes == block_hashes(tokens, 4)


def test_match_insert_forget_and_events():
    events = KVEventRecorder()
    cache = PrefixCache(4, events)
    hashes = block_hashes(list(range(12)), 4)
    assert cache.insert(7, hashes[0], None, [0, 1, 2, 3], None)
    assert cache.insert(3, hashes[1], hashes[0], [4, 5, 6, 7], None)
    assert not cache.insert(5, hashes[1], hashes[0], [4, 5, 6, 7], None)  # already held by block 3
    result = cache.match(hashes)
    assert result.blocks == (7, 3) and result.num_cached_tokens == 8
    assert cache.match(hashes, max_blocks=1).blocks == (7,)
    assert cache.match(block_hashes([99] + list(range(1, 12)), 4)).blocks == ()  # first block differs
    cache.forget([7, 11])
    assert cache.match(hashes).blocks == ()
    assert events.drain() == [BlockStored(hashes[0], None, (0, 1, 2, 3)),
                              BlockStored(hashes[1], hashes[0], (4, 5, 6, 7)), BlockRemoved((hashes[0],))]
    with pytest.raises(ValueError, match="already caches"):
        cache.insert(3, 12345, None, [9, 9, 9, 9], None)
    cache.check_integrity()
