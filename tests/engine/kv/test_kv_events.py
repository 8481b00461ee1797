"""The replica's KV event log (engine/kv/kv_events.py) as the router polls it: numbered events, bounded memory, None
when the reader must resynchronize, and safe to append to from the engine thread while other threads read. The
last tests feed a real prefix cache's events through the log into the router's PrefixIndex."""

from __future__ import annotations

import random
import sys
import threading

import pytest
from hypothesis import given, settings, strategies as st

from tandem.engine.core.kv_cache_manager import KVCacheManager
from tandem.engine.kv.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, KVEventLog,
                                     KVSnapshot)
from tandem.engine.kv.prefix_cache import PrefixCache, block_hashes
from tandem.engine.request import Sequence
from tandem.engine.sampling_params import SamplingParams
from tandem.router.kv_index import PrefixIndex


def event(i: int) -> BlockRemoved:
    return BlockRemoved((i,))


def filled(n: int, capacity: int = 65536) -> KVEventLog:
    log = KVEventLog(capacity)
    for i in range(n):
        log(event(i))
    return log


# --- numbering and reading -------------------------------------------------------------------------------------------


def test_events_are_numbered_from_zero_and_read_in_order():
    log = KVEventLog()
    assert log.next_seq == 0
    assert log.read(log.epoch, 0) == KVEventBatch(log.epoch, 0, ())
    for i in range(5):
        log(event(i))
        assert log.next_seq == i + 1
    batch = log.read(log.epoch, 0)
    assert batch.epoch == log.epoch and batch.first_seq == 0
    assert batch.events == tuple(event(i) for i in range(5))
    assert batch.next_seq == 5
    assert log.read(log.epoch, 3).events == (event(3), event(4))


def test_read_respects_limit_and_the_next_read_goes_on_from_next_seq():
    log = filled(10)
    seen, since = [], 0
    while True:
        batch = log.read(log.epoch, since, limit=3)
        assert batch.first_seq == since and len(batch.events) <= 3
        if not batch.events:
            break
        seen.extend(batch.events)
        since = batch.next_seq
    assert seen == [event(i) for i in range(10)]
    assert since == log.next_seq == 10


def test_reading_at_the_end_gives_an_empty_batch_until_more_arrive():
    log = filled(4)
    batch = log.read(log.epoch, 4)
    assert batch == KVEventBatch(log.epoch, 4, ()) and batch.next_seq == 4
    log(event(4))
    assert log.read(log.epoch, 4).events == (event(4),)


def test_a_batch_is_a_snapshot_not_a_view():
    log = filled(2)
    batch = log.read(log.epoch, 0)
    log(event(2))
    assert batch.events == (event(0), event(1)) and batch.next_seq == 2


@pytest.mark.parametrize("epoch", [None, "", "another-epoch"])
def test_a_wrong_epoch_means_resynchronize(epoch):
    log = filled(3)
    assert log.read(epoch, 0) is None
    assert log.read(epoch, 3) is None


def test_two_logs_have_different_epochs_and_do_not_accept_each_others():
    a, b = filled(3), filled(3)
    assert a.epoch != b.epoch
    assert a.read(b.epoch, 0) is None and b.read(a.epoch, 0) is None
    assert KVEventLog(epoch="fixed").epoch == "fixed"


def test_a_since_beyond_next_seq_means_resynchronize():
    log = filled(3)
    assert log.read(log.epoch, 4) is None
    assert log.read(log.epoch, -1) is None


def test_the_log_keeps_only_capacity_events_and_an_older_since_means_resynchronize():
    log = filled(10, capacity=4)
    assert log.next_seq == 10  # numbering goes on past what is kept
    assert log.read(log.epoch, 5) is None  # event 5 is gone: 6..9 are kept
    assert log.read(log.epoch, 0) is None
    batch = log.read(log.epoch, 6)
    assert batch.first_seq == 6 and batch.events == tuple(event(i) for i in range(6, 10))
    assert log.read(log.epoch, 10).events == ()


@given(capacity=st.integers(1, 8), appended=st.integers(0, 20), since=st.integers(-2, 24),
       limit=st.integers(1, 10))
def test_read_gives_exactly_the_kept_events_from_since_on(capacity, appended, since, limit):
    log = filled(appended, capacity)
    first_kept = max(0, appended - capacity)
    batch = log.read(log.epoch, since, limit=limit)
    if not first_kept <= since <= appended:
        assert batch is None
    else:
        assert batch.first_seq == since
        assert batch.events == tuple(event(i) for i in range(since, min(since + limit, appended)))


@pytest.mark.parametrize("capacity", [0, -1])
def test_capacity_below_one_is_refused(capacity):
    with pytest.raises(ValueError, match=f"capacity must be at least 1, got {capacity}"):
        KVEventLog(capacity)


def test_a_snapshot_and_a_batch_name_where_a_reader_goes_on():
    log = filled(3)
    snapshot = KVSnapshot(log.epoch, log.next_seq, (7, 8))
    log(event(3))
    batch = log.read(snapshot.epoch, snapshot.next_seq)
    assert batch.events == (event(3),) and batch.next_seq == 4


# --- threads ---------------------------------------------------------------------------------------------------------


def test_concurrent_appends_and_reads_never_skip_or_reorder_events():
    writers, per_writer = 4, 2000
    log = KVEventLog(capacity=writers * per_writer)
    start = threading.Barrier(writers + 1)

    def write(w: int) -> None:
        start.wait()
        for i in range(per_writer):
            log(BlockRemoved((w, i)))

    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible, so appends and reads interleave
    try:
        threads = [threading.Thread(target=write, args=(w,)) for w in range(writers)]
        for t in threads:
            t.start()
        start.wait()
        seen: list[tuple[int, int]] = []
        since = 0
        while True:
            done = not any(t.is_alive() for t in threads)
            batch = log.read(log.epoch, since, limit=97)
            assert batch is not None and batch.first_seq == since
            seen.extend(e.block_hashes for e in batch.events)
            since = batch.next_seq
            if done and not batch.events:
                break
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old_interval)
    assert len(seen) == writers * per_writer == log.next_seq
    for w in range(writers):  # each writer's events, in its own order, none missing or repeated
        assert [i for writer, i in seen if writer == w] == list(range(per_writer))


# --- a real prefix cache, through the log, into the router's index ---------------------------------------------------


class Poller:
    """What the router's KV feed does with one replica: read from where it is, resynchronize from a snapshot of
    the cache when read() says the place is gone (as replica/shell.py answers)."""

    def __init__(self, log: KVEventLog, hashes, name: str = "r0", limit: int = 5):
        self.log, self.hashes, self.name, self.limit = log, hashes, name, limit
        self.index = PrefixIndex(ttl_s=1.0, clock=lambda: 0.0)
        self.epoch: str | None = None
        self.next_seq = 0
        self.snapshots = 0

    def poll(self) -> None:
        while True:
            batch = self.log.read(self.epoch, self.next_seq, limit=self.limit)
            if batch is None:
                snapshot = KVSnapshot(self.log.epoch, self.log.next_seq, tuple(self.hashes()))
                self.index.apply_snapshot(self.name, snapshot.block_hashes)
                self.epoch, self.next_seq = snapshot.epoch, snapshot.next_seq
                self.snapshots += 1
                continue
            self.index.apply(self.name, batch.events)
            self.next_seq = batch.next_seq
            if not batch.events:
                return

    def assert_matches(self, held) -> None:
        held = set(held)
        self.index.check_integrity()
        assert self.index.num_blocks(self.name) == len(held) == len(self.index)
        for h in held:
            assert self.index.overlap([h]) == {self.name: 1}


BLOCK = 4


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["insert", "forget", "poll"]), st.integers(0, 11)), max_size=40),
       capacity=st.sampled_from([3, 64]))
def test_prefix_cache_events_replayed_into_the_index_equal_the_cache(ops, capacity):
    log = KVEventLog(capacity)
    cache = PrefixCache(BLOCK, log)
    poller = Poller(log, cache.hashes)
    for op, n in ops:
        if op == "insert":  # block n caches the n-th block of one long prompt (a no-op if it is cached already)
            tokens = list(range(n * BLOCK, (n + 1) * BLOCK))
            if not cache.is_cached(n):
                cache.insert(n, hash((n, 17)), None, tokens, None)
        elif op == "forget":
            cache.forget([n, (n + 5) % 12])
        else:
            poller.poll()
            poller.assert_matches(cache.hashes())
        cache.check_integrity()
    poller.poll()
    poller.assert_matches(cache.hashes())
    if capacity >= 64:
        assert poller.snapshots == 1  # only the first poll, with no epoch yet, asks for a snapshot


def test_kv_cache_manager_eviction_and_reset_reach_the_index():
    rng = random.Random(7)
    log = KVEventLog(capacity=4)  # small: the poller falls behind and must resynchronize at times
    kinds: list[type] = []

    def sink(event) -> None:
        kinds.append(type(event))
        log(event)

    kv = KVCacheManager(12, BLOCK, event_sink=sink)
    poller = Poller(log, kv.cache.hashes, limit=3)
    params = SamplingParams(max_tokens=4, temperature=0)
    prefixes = [tuple(rng.randrange(100) for _ in range(3 * BLOCK)) for _ in range(3)]
    for i in range(30):
        prompt = prefixes[i % 3] + tuple(rng.randrange(100) for _ in range(rng.randrange(1, 2 * BLOCK)))
        seq = Sequence(f"s{i}", f"q{i}", 0, prompt, params, 0, 0, i, None, BLOCK)
        match = kv.match_prefix(seq)
        if kv.allocate(seq, seq.num_tokens - match.num_cached_tokens, match) is None:
            continue
        seq.num_computed_tokens = seq.num_tokens
        kv.cache_full_blocks(seq)
        kv.free(seq)  # the blocks stay cached (parked) until a later allocation evicts them
        kv.check_integrity()
        if i % 4 == 3:
            poller.poll()
            poller.assert_matches(kv.cache.hashes())
            if i > 4:  # the shared prefixes were seen and cached: the index can route to them
                hashes = block_hashes(prefixes[i % 3], BLOCK)
                cached = len(kv.cache.match(hashes).blocks)
                assert poller.index.overlap(hashes) == ({"r0": cached} if cached else {})
    assert BlockRemoved in kinds, "the pool is small enough that later prompts evict cached blocks"
    assert poller.snapshots > 1, "the small log should have forced a resynchronization"
    assert kv.reset_prefix_cache() > 0
    poller.poll()
    poller.assert_matches(kv.cache.hashes())
    assert len(poller.index) == 0


def test_all_blocks_cleared_in_the_log_empties_the_replicas_view():
    log = KVEventLog()
    cache = PrefixCache(BLOCK, log)
    hashes = block_hashes(list(range(3 * BLOCK)), BLOCK)
    for block, h in enumerate(hashes):
        cache.insert(block, h, hashes[block - 1] if block else None, list(range(block * BLOCK, (block + 1) * BLOCK)),
                     None)
    log(AllBlocksCleared())
    log(BlockStored(hashes[0], None, tuple(range(BLOCK))))
    index = PrefixIndex()
    index.apply("r0", log.read(log.epoch, 0).events)
    assert index.overlap(hashes) == {"r0": 1}
    assert index.num_blocks("r0") == 1
