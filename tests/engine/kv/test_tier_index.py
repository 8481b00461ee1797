"""The KV tiers' index (engine/kv/tier_index.py): LRU within a byte budget, blocks being written or read never
evicted or seen half-written, and any sequence of admit / ready / lookup / pin / unpin / remove keeping each slot
owned once (a hypothesis state machine against a plain model of the tier)."""

from __future__ import annotations

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from tandem.engine.kv.tier_index import TierIndex


def test_a_budget_buys_whole_blocks_and_holds_at_least_one():
    assert TierIndex("host", 10_000, 1_000).num_slots == 10
    assert TierIndex("host", 10_999, 1_000).num_slots == 10
    with pytest.raises(ValueError, match="hold no KV block"):
        TierIndex("disk", 999, 1_000)


def test_the_least_recently_used_ready_block_leaves_first():
    tier = TierIndex("host", 3, 1)
    for h in (1, 2, 3):
        tier.ready(h) if tier.admit(h) else pytest.fail("admit refused")
    assert tier.lookup(1) is not None  # 1 is now the most recently used: 2 leaves first
    admission = tier.admit(4)
    assert [h for h, _ in admission.evicted] == [2] and admission.slot == dict(admission.evicted)[2]
    tier.ready(4)
    assert 2 not in tier and tier.hashes() == (3, 1, 4)
    assert tier.match([3, 1, 4, 2, 1]) == 3
    tier.check_integrity()


def test_a_block_being_written_is_invisible_and_pinned_blocks_are_never_evicted():
    tier = TierIndex("host", 2, 1)
    first = tier.admit(10)
    assert 10 not in tier and tier.lookup(10) is None and tier.match([10]) == 0  # not yet written
    assert tier.admit(10) is None  # already admitted
    tier.admit(11)
    assert tier.admit(12) is None  # both slots mid-write: nothing may leave
    tier.ready(10)
    tier.pin(10)  # being copied out
    assert tier.admit(12) is None
    tier.ready(11)
    assert [h for h, _ in tier.admit(12).evicted] == [11]  # 10 is pinned, 11 is not
    with pytest.raises(ValueError, match="being read"):
        tier.remove(10)
    tier.unpin(10)
    assert tier.remove(10) == first.slot and 10 not in tier
    with pytest.raises(ValueError, match="not pinned"):
        tier.unpin(10)
    tier.check_integrity()


class TierMachine(RuleBasedStateMachine):
    """A tier of 4 slots against a model: a dict of what is readable, what is mid-write and the pins."""

    def __init__(self):
        super().__init__()
        self.tier = TierIndex("host", 4 * 64, 64)
        self.readable: dict[int, int] = {}  # hash -> slot
        self.writing: dict[int, int] = {}
        self.pins: dict[int, int] = {}

    @rule(h=st.integers(0, 9))
    def admit(self, h):
        before = set(self.readable) | set(self.writing)
        result = self.tier.admit(h)
        if h in before:
            assert result is None
            return
        if result is None:  # full of pinned blocks
            assert len(before) == 4 and all(self.pins.get(x, 0) > 0 for x in before)
            return
        for victim, slot in result.evicted:
            assert victim in self.readable and self.pins.get(victim, 0) == 0 and self.readable[victim] == slot
            del self.readable[victim]
        assert result.slot not in set(self.readable.values()) | set(self.writing.values())
        self.writing[h] = result.slot
        self.pins[h] = 1

    @rule(h=st.integers(0, 9))
    def ready(self, h):
        if h not in self.writing:
            with pytest.raises(ValueError):
                self.tier.ready(h)
            return
        self.tier.ready(h)
        self.readable[h] = self.writing.pop(h)
        self.pins[h] -= 1

    @rule(h=st.integers(0, 9))
    def lookup(self, h):
        assert self.tier.lookup(h) == self.readable.get(h)

    @rule(h=st.integers(0, 9))
    def pin(self, h):
        if h not in self.readable:
            with pytest.raises(KeyError):
                self.tier.pin(h)
            return
        assert self.tier.pin(h) == self.readable[h]
        self.pins[h] = self.pins.get(h, 0) + 1

    @rule(h=st.integers(0, 9))
    def unpin(self, h):
        if self.pins.get(h, 0) == 0 or h in self.writing and self.pins[h] == 1:
            if self.pins.get(h, 0) == 0:
                with pytest.raises(ValueError):
                    self.tier.unpin(h)
            return
        self.tier.unpin(h)
        self.pins[h] -= 1

    @rule(h=st.integers(0, 9))
    def remove(self, h):
        here = h in self.readable or h in self.writing
        readers = self.pins.get(h, 0) - (1 if h in self.writing else 0)
        if here and readers > 0:
            with pytest.raises(ValueError):
                self.tier.remove(h)
            return
        slot = self.tier.remove(h)
        assert slot == (self.readable.pop(h, None) if h in self.readable else self.writing.pop(h, None))
        self.pins.pop(h, None)

    @invariant()
    def consistent(self):
        self.tier.check_integrity()
        assert set(self.tier.hashes()) == set(self.readable)
        assert len(self.tier) == len(self.readable) + len(self.writing)


TestTierMachine = TierMachine.TestCase
TestTierMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
