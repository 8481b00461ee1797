"""The router's prefix index (router/kv_index.py): overlap() answers what a brute-force reading of every
replica's events, snapshots and expectations would answer, and the index checks itself after every step.

The clock is injected (a one-element list the tests advance), so expectation deadlines are exact."""

from __future__ import annotations

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tandem.engine.kv.kv_events import DISK, HOST, AllBlocksCleared, BlockRemoved, BlockStored
from tandem.router.kv_index import PrefixIndex

TTL = 5.0


def make_index(ttl_s: float = TTL) -> tuple[PrefixIndex, list[float]]:
    t = [0.0]
    return PrefixIndex(ttl_s=ttl_s, clock=lambda: t[0]), t


def stored(*hashes: int) -> list[BlockStored]:
    return [BlockStored(h, None, (h,)) for h in hashes]


# --- a reference model: per replica, confirmed hashes and expected hashes with their deadlines ---------------------


class Reference:
    """What the index should believe, computed the slow way."""

    def __init__(self, ttl_s: float):
        self.ttl_s = ttl_s
        self.now = 0.0
        self.confirmed: dict[str, set[int]] = {}
        self.expected: dict[str, dict[int, float]] = {}
        self.lower: dict[tuple[str, str], set[int]] = {}  # (replica, "host" | "disk") -> hashes

    def on_device(self, replica: str) -> set[int]:
        live = {h for h, deadline in self.expected.get(replica, {}).items() if self.now < deadline}
        return self.confirmed.get(replica, set()) | live

    def held(self, replica: str) -> set[int]:
        return self.on_device(replica) | self.lower.get((replica, HOST), set()) | self.lower.get((replica, DISK), set())

    def lower_tier_blocks(self, replica: str, query: list[int]) -> tuple[int, int]:
        host, disk = self.lower.get((replica, HOST), set()), self.lower.get((replica, DISK), set())
        below = [h for h in query if h not in self.on_device(replica)]
        return sum(h in host for h in below), sum(h in disk and h not in host for h in below)

    def replicas(self) -> set[str]:
        return set(self.confirmed) | set(self.expected) | {r for r, _ in self.lower}

    def overlap(self, query: list[int]) -> dict[str, int]:
        result = {}
        for replica in self.replicas():
            held, n = self.held(replica), 0
            while n < len(query) and query[n] in held:
                n += 1
            if n:
                result[replica] = n
        return result

    def store(self, replica: str, h: int) -> None:
        self.confirmed.setdefault(replica, set()).add(h)
        self.expected.get(replica, {}).pop(h, None)

    def drop(self, replica: str, h: int) -> None:
        self.confirmed.get(replica, set()).discard(h)
        self.expected.get(replica, {}).pop(h, None)

    def forget(self, replica: str) -> None:
        self.confirmed.pop(replica, None)
        self.expected.pop(replica, None)
        self.lower.pop((replica, HOST), None)
        self.lower.pop((replica, DISK), None)

    def expect(self, replica: str, hashes: list[int]) -> None:
        for h in hashes:
            if h not in self.confirmed.get(replica, set()):
                self.expected.setdefault(replica, {})[h] = self.now + self.ttl_s

    def distinct(self) -> int:
        return len(set().union(*(self.held(r) for r in self.replicas())))


REPLICAS = ["r0", "r1", "r2"]
replica = st.sampled_from(REPLICAS)
block = st.integers(0, 7)  # a small hash space makes shared and contested blocks common
blocks = st.lists(block, max_size=6)


class PrefixIndexMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.index, self.t = make_index(TTL)
        self.ref = Reference(TTL)

    @rule(r=replica, hashes=blocks)
    def block_stored(self, r, hashes):
        self.index.apply(r, stored(*hashes))
        for h in hashes:
            self.ref.store(r, h)

    @rule(r=replica, hashes=blocks)
    def block_removed(self, r, hashes):
        self.index.apply(r, [BlockRemoved(tuple(hashes))])
        for h in hashes:
            self.ref.drop(r, h)

    @rule(r=replica, tier=st.sampled_from([HOST, DISK]), hashes=blocks)
    def stored_on_a_lower_tier(self, r, tier, hashes):
        self.index.apply(r, [BlockStored(h, None, (), None, tier) for h in hashes])
        self.ref.lower.setdefault((r, tier), set()).update(hashes)

    @rule(r=replica, tier=st.sampled_from([HOST, DISK]), hashes=blocks)
    def removed_from_a_lower_tier(self, r, tier, hashes):
        self.index.apply(r, [BlockRemoved(tuple(hashes), tier)])
        self.ref.lower.get((r, tier), set()).difference_update(hashes)

    @rule(r=replica, before=blocks, after=blocks)
    def stored_cleared_stored(self, r, before, after):
        self.index.apply(r, [*stored(*before), AllBlocksCleared(), *stored(*after)])
        self.ref.forget(r)
        for h in after:
            self.ref.store(r, h)

    @rule(r=replica, hashes=blocks, host=blocks, disk=blocks)
    def snapshot(self, r, hashes, host, disk):
        self.index.apply_snapshot(r, hashes, host, disk)
        self.ref.forget(r)
        for h in hashes:
            self.ref.store(r, h)
        self.ref.lower[(r, HOST)], self.ref.lower[(r, DISK)] = set(host), set(disk)

    @rule(r=replica, hashes=blocks)
    def expect(self, r, hashes):
        self.index.expect(r, hashes)
        self.ref.expect(r, hashes)

    @precondition(lambda self: any(self.ref.expected.values()))
    @rule(data=st.data(), dt=st.sampled_from([1.0, 2.5]))
    def expect_again_later(self, data, dt):
        """A later request sharing a prefix that is already expected somewhere: it pushes the deadline back."""
        self.advance_clock(dt)
        r = data.draw(st.sampled_from(sorted(r for r, hashes in self.ref.expected.items() if hashes)))
        self.expect(r, data.draw(st.lists(st.sampled_from(sorted(self.ref.expected[r])), min_size=1, max_size=3)))

    @rule(r=replica)
    def remove_replica(self, r):
        self.index.remove_replica(r)
        self.ref.forget(r)

    @rule(dt=st.sampled_from([0.5, 1.0, 2.5, TTL - 1.0, TTL, TTL + 1.0]))
    def advance_clock(self, dt):
        self.t[0] += dt
        self.ref.now = self.t[0]

    @rule(query=st.lists(block, max_size=8))
    def overlap(self, query):
        overlap = self.index.overlap(query)
        assert overlap == self.ref.overlap(query)
        for r, depth in overlap.items():
            assert self.index.lower_tier_blocks(r, query[:depth]) == self.ref.lower_tier_blocks(r, query[:depth])
        for r in REPLICAS:
            confirmed = self.ref.confirmed.get(r, set())
            anywhere = confirmed | self.ref.lower.get((r, HOST), set()) | self.ref.lower.get((r, DISK), set())
            assert self.index.confirmed_depth(r, query) == next(
                (i for i, h in enumerate(query) if h not in confirmed), len(query))
            assert self.index.confirmed_depth(r, query, tiers=True) == next(
                (i for i, h in enumerate(query) if h not in anywhere), len(query))

    @invariant()
    def matches_reference(self):
        self.index.check_integrity()
        assert len(self.index) == self.ref.distinct()  # first: len() must expire what is due by itself
        for r in REPLICAS:
            assert self.index.num_blocks(r) == len(self.ref.confirmed.get(r, ()))
        for h in range(8):  # every single-block query, and a few long ones
            assert self.index.overlap([h]) == self.ref.overlap([h])
        for query in ([0, 1, 2, 3, 4, 5, 6, 7], [7, 6, 5, 4, 3, 2, 1, 0], [0, 0, 1, 1]):
            assert self.index.overlap(query) == self.ref.overlap(query)
        self.index.check_integrity()


TestPrefixIndexMachine = PrefixIndexMachine.TestCase
TestPrefixIndexMachine.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)


# --- overlap ---------------------------------------------------------------------------------------------------------


def test_overlap_counts_leading_blocks_per_replica():
    index, _ = make_index()
    index.apply("a", stored(1, 2, 3))
    index.apply("b", stored(1, 2))
    index.apply("c", stored(2, 3, 4))  # holds a tail of the query but not its head
    assert index.overlap([1, 2, 3, 4]) == {"a": 3, "b": 2}
    assert index.overlap([1, 3]) == {"a": 2, "b": 1}  # held, even if not where a real chain would put it
    assert index.overlap([2, 3, 4]) == {"a": 2, "b": 1, "c": 3}
    assert index.overlap([9, 1]) == {}
    assert index.overlap([]) == {}
    index.check_integrity()


# --- expectations ----------------------------------------------------------------------------------------------------


def test_an_expectation_counts_until_ttl_passes_then_vanishes():
    index, t = make_index(ttl_s=5.0)
    index.expect("a", [1, 2])
    assert index.overlap([1, 2]) == {"a": 2}
    assert index.num_blocks("a") == 0  # expected, not confirmed
    t[0] = 4.9
    assert index.overlap([1, 2]) == {"a": 2}
    t[0] = 5.0
    assert index.overlap([1, 2]) == {}
    assert len(index) == 0
    index.check_integrity()


def test_a_confirmed_expectation_outlives_the_ttl():
    index, t = make_index(ttl_s=5.0)
    index.expect("a", [1, 2, 3])
    t[0] = 1.0
    index.apply("a", stored(1, 2))  # block 3 never arrives
    assert index.num_blocks("a") == 2
    t[0] = 100.0
    assert index.overlap([1, 2, 3]) == {"a": 2}
    assert len(index) == 2
    index.check_integrity()


def test_re_expecting_extends_the_deadline():
    index, t = make_index(ttl_s=5.0)
    index.expect("a", [1])
    t[0] = 3.0
    index.expect("a", [1])  # a second request with the same prefix: now due at 8
    t[0] = 6.0
    assert index.overlap([1]) == {"a": 1}
    t[0] = 8.0
    assert index.overlap([1]) == {}
    index.check_integrity()


def test_expecting_a_confirmed_block_does_not_let_it_expire():
    index, t = make_index(ttl_s=5.0)
    index.apply("a", stored(1))
    index.expect("a", [1, 2])
    t[0] = 10.0
    assert index.overlap([1, 2]) == {"a": 1}
    assert index.num_blocks("a") == 1
    index.check_integrity()


def test_removing_an_expected_block_drops_the_expectation():
    index, t = make_index(ttl_s=5.0)
    index.expect("a", [1, 2])
    index.apply("a", [BlockRemoved((2,))])
    assert index.overlap([1, 2]) == {"a": 1}
    assert len(index) == 1
    index.check_integrity()
    # A later store of the same hash is a confirmation, not the stale expectation coming back to expire it.
    index.apply("a", stored(2))
    t[0] = 10.0
    assert index.overlap([1, 2]) == {}  # block 1 expired; block 2 is confirmed but is not a prefix
    assert index.overlap([2]) == {"a": 1}
    index.check_integrity()


def test_expectations_are_per_replica():
    index, t = make_index(ttl_s=5.0)
    index.expect("a", [1])
    t[0] = 3.0
    index.expect("b", [1])
    index.apply("a", [BlockRemoved((1,))])
    assert index.overlap([1]) == {"b": 1}
    t[0] = 8.0
    assert index.overlap([1]) == {}
    index.check_integrity()


def test_len_forgets_expired_expectations_without_a_read():
    # len() feeds the tandem_prefix_index_blocks gauge, read while the router may be idle (no overlap() calls).
    index, t = make_index(ttl_s=5.0)
    index.expect("a", [1, 2])
    assert len(index) == 2
    t[0] = 6.0
    assert len(index) == 0
    index.check_integrity()


# --- snapshots, clears, removal --------------------------------------------------------------------------------------


def test_a_snapshot_replaces_exactly_one_replicas_view():
    index, _ = make_index()
    index.apply("a", stored(1, 2, 3))
    index.apply("b", stored(1, 2, 3))
    index.expect("a", [4])
    index.apply_snapshot("a", [1, 5])
    assert index.num_blocks("a") == 2 and index.num_blocks("b") == 3
    assert index.overlap([1, 2, 3]) == {"a": 1, "b": 3}
    assert index.overlap([1, 5]) == {"a": 2, "b": 1}
    assert index.overlap([4]) == {}  # the snapshot is the whole truth about a: its expectations are gone too
    assert len(index) == 4  # 1, 2, 3, 5
    index.check_integrity()


def test_all_blocks_cleared_forgets_only_that_replica_and_later_events_apply():
    index, _ = make_index()
    index.apply("b", stored(1))
    index.apply("a", [*stored(1, 2), AllBlocksCleared(), *stored(3)])
    assert index.num_blocks("a") == 1
    assert index.overlap([1, 2]) == {"b": 1}
    assert index.overlap([3]) == {"a": 1}
    index.check_integrity()


def test_remove_replica_forgets_confirmed_and_expected_blocks():
    index, _ = make_index()
    index.apply("a", stored(1, 2))
    index.expect("a", [3])
    index.apply("b", stored(2))
    index.remove_replica("a")
    index.remove_replica("never-seen")
    assert index.num_blocks("a") == 0
    assert index.overlap([1, 2, 3]) == {}
    assert index.overlap([2]) == {"b": 1}
    assert len(index) == 1
    index.check_integrity()


def test_removing_a_block_the_replica_never_held_changes_nothing():
    index, _ = make_index()
    index.apply("a", stored(1))
    index.apply("b", [BlockRemoved((1, 7))])
    assert index.overlap([1]) == {"a": 1}
    assert len(index) == 1 and index.num_blocks("a") == 1 and index.num_blocks("b") == 0
    index.check_integrity()


def test_len_counts_distinct_hashes_and_num_blocks_counts_confirmed_ones():
    index, _ = make_index()
    index.apply("a", stored(1, 2, 2))  # a repeated event is one block
    index.apply("b", stored(2, 3))
    index.expect("b", [4, 3])
    assert len(index) == 4  # 1, 2, 3, 4: held twice is still one hash
    assert (index.num_blocks("a"), index.num_blocks("b"), index.num_blocks("c")) == (2, 2, 0)


def test_check_integrity_catches_a_holder_without_a_source():
    index, _ = make_index()
    index.apply("a", stored(1))
    index.check_integrity()
    index._holders[1] |= 1 << 7  # a replica bit nobody owns: what a missed _unhold would leave
    with pytest.raises(ValueError, match="disagree"):
        index.check_integrity()
