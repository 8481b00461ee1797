"""The router's index of which replica holds which KV block, by the chained block hashes of
engine/kv/prefix_cache.py: fed by the replicas' KV events, read once per request to score cached-prefix overlap.

The index is approximate on purpose. Between polls it lags the replicas; a lost event leaves a block counted
where it is gone (or missing where it is held), which costs routing quality and nothing else, since each replica
matches the prefix against its own cache. Two mechanisms keep it close:

  - resync: a replica answers with a snapshot of its whole cache when the router's place in its event log is
    gone or belongs to an earlier incarnation (restart); apply_snapshot() replaces what the index believed;
  - expectation: when a request is sent to a replica, its prompt's blocks are expected there (expect()) until
    the replica's events confirm them or `ttl_s` passes, so that a burst of requests sharing a prefix follows
    the first one instead of scattering before any event arrives.

A replica with KV tiers (engine/core/kv_tiers.py) also publishes the blocks it holds in host memory and on disk:
overlap() counts a block held on any tier, and lower_tier_blocks() says how many of a replica's matched blocks
are only on its host or disk tier, so that routing can weigh those hits by what copying them up costs.

Plain Python over ints and strings; no Ray, no gRPC.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable, Iterable, Sequence

from tandem.engine.kv.kv_events import DEVICE, DISK, HOST, AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

_TIER_BITS = {HOST: 1, DISK: 2}


class PrefixIndex:
    """Holders are kept as one int bit mask per hash (bit i: the replica with slot i), so that the index holds no
    container object per block: at 100k blocks, per-hash sets made every full garbage collection of the router
    take about 100 ms, and a request arriving then waited for it. Overlap is then a few big-int ANDs per block."""

    def __init__(self, *, ttl_s: float = 5.0, clock: Callable[[], float] = time.monotonic):
        self.ttl_s = ttl_s
        self.clock = clock
        self._holders: dict[int, int] = {}  # hash -> bit mask of the replicas holding it (any tier, or expected)
        self._confirmed: dict[str, set[int]] = {}  # replica -> hashes its events reported on the device
        self._lower: dict[str, dict[int, int]] = {}  # replica -> hash -> its lower tiers' bits (_TIER_BITS)
        self._expected: dict[str, dict[int, float]] = {}  # replica -> hash -> deadline
        self._deadlines: deque[tuple[float, str, tuple[int, ...]]] = deque()
        self._slots: dict[str, int] = {}  # replica -> its bit
        self._names: list[str | None] = []  # bit -> replica (None: free)

    def __len__(self) -> int:
        """Distinct block hashes indexed (confirmed or expected and not expired)."""
        self._expire()
        return len(self._holders)

    def num_blocks(self, replica: str) -> int:
        """Blocks the index believes replica holds on the device (confirmed ones)."""
        return len(self._confirmed.get(replica, ()))

    def num_lower_blocks(self, replica: str) -> int:
        """Blocks the index believes replica holds on its host or disk tier (on the device too or not)."""
        return len(self._lower.get(replica, ()))

    # ---- updates ----

    def apply(self, replica: str, events: Iterable[KVEvent]) -> None:
        """Applies replica's events in order."""
        for event in events:
            if isinstance(event, BlockStored):
                if event.tier == DEVICE:
                    self._store(replica, event.block_hash)
                else:
                    self._store_lower(replica, event.block_hash, _TIER_BITS[event.tier])
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    if event.tier == DEVICE:
                        self._drop(replica, h)
                    else:
                        self._drop_lower(replica, h, _TIER_BITS[event.tier])
            elif isinstance(event, AllBlocksCleared):
                self.remove_replica(replica)

    def apply_snapshot(self, replica: str, block_hashes: Iterable[int], host_hashes: Iterable[int] = (),
                       disk_hashes: Iterable[int] = ()) -> None:
        """replica holds exactly block_hashes on the device, host_hashes and disk_hashes on its tiers now:
        whatever the index believed about it is replaced."""
        self.remove_replica(replica)
        for h in block_hashes:
            self._store(replica, h)
        for tier, hashes in ((HOST, host_hashes), (DISK, disk_hashes)):
            for h in hashes:
                self._store_lower(replica, h, _TIER_BITS[tier])

    def expect(self, replica: str, block_hashes: Sequence[int]) -> None:
        """The blocks of a prompt just sent to replica: counted as held there until confirmed or ttl_s passes."""
        self._expire()
        deadline = self.clock() + self.ttl_s
        expected = self._expected.setdefault(replica, {})
        confirmed = self._confirmed.get(replica, ())
        bit = self._bit(replica)
        holders = self._holders
        fresh = tuple(h for h in block_hashes if h not in confirmed)
        for h in fresh:
            expected[h] = deadline
            holders[h] = holders.get(h, 0) | bit
        if fresh:
            self._deadlines.append((deadline, replica, fresh))

    def remove_replica(self, replica: str) -> None:
        """Forgets everything about replica (it left the pool, restarted or cleared its cache)."""
        slot = self._slots.pop(replica, None)
        if slot is None:
            return
        held = self._confirmed.pop(replica, set()) | set(self._expected.pop(replica, {})) | \
            set(self._lower.pop(replica, {}))
        for h in held:
            self._unhold(1 << slot, h)
        self._names[slot] = None

    # ---- reads ----

    def overlap(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """For every replica holding the first of block_hashes: how many leading blocks of block_hashes it holds.
        Replicas holding none are absent. Costs O(matched blocks) big-int ANDs, not O(index size)."""
        self._expire()
        if not block_hashes:
            return {}
        holders = self._holders
        alive = holders.get(block_hashes[0], 0)
        if not alive:
            return {}
        depth: dict[str, int] = {}
        i = 1
        for i in range(1, len(block_hashes)):
            here = alive & holders.get(block_hashes[i], 0)
            if here != alive:
                self._name_bits(alive & ~here, i, depth)
                alive = here
                if not alive:
                    break
        else:
            i = len(block_hashes)
        self._name_bits(alive, i, depth)
        return depth

    def confirmed_depth(self, replica: str, block_hashes: Sequence[int], *, tiers: bool = False) -> int:
        """How many leading blocks of block_hashes replica's events confirmed it holds on its device (tiers: or on
        a lower tier). Expected ones are not counted: they may not be computed yet."""
        held = self._confirmed.get(replica, ())
        lower = self._lower.get(replica, {}) if tiers else {}
        depth = 0
        for h in block_hashes:
            if h not in held and h not in lower:
                break
            depth += 1
        return depth

    def lower_tier_blocks(self, replica: str, block_hashes: Sequence[int]) -> tuple[int, int]:
        """Of block_hashes (a prefix overlap() matched on replica), how many replica holds only on its host tier
        and how many only on its disk tier: not on the device nor expected there. (0, 0) at once for a replica
        that publishes no tiers."""
        lower = self._lower.get(replica)
        if not lower:
            return 0, 0
        device = self._confirmed.get(replica, ())
        expected = self._expected.get(replica, {})
        host = disk = 0
        for h in block_hashes:
            if h in device or h in expected:
                continue
            bits = lower.get(h, 0)
            if bits & _TIER_BITS[HOST]:
                host += 1
            elif bits:
                disk += 1
        return host, disk

    # ---- internals ----

    def _bit(self, replica: str) -> int:
        slot = self._slots.get(replica)
        if slot is None:
            slot = next((i for i, name in enumerate(self._names) if name is None), len(self._names))
            if slot == len(self._names):
                self._names.append(replica)
            else:
                self._names[slot] = replica
            self._slots[replica] = slot
        return 1 << slot

    def _name_bits(self, mask: int, depth: int, into: dict[str, int]) -> None:
        while mask:
            low = mask & -mask
            into[self._names[low.bit_length() - 1]] = depth
            mask ^= low

    def _store(self, replica: str, h: int) -> None:
        self._confirmed.setdefault(replica, set()).add(h)
        expected = self._expected.get(replica)
        if expected:
            expected.pop(h, None)
        self._holders[h] = self._holders.get(h, 0) | self._bit(replica)

    def _store_lower(self, replica: str, h: int, bit: int) -> None:
        lower = self._lower.setdefault(replica, {})
        lower[h] = lower.get(h, 0) | bit
        self._holders[h] = self._holders.get(h, 0) | self._bit(replica)

    def _drop(self, replica: str, h: int) -> None:
        confirmed = self._confirmed.get(replica)
        if confirmed:
            confirmed.discard(h)
        expected = self._expected.get(replica)
        if expected:
            expected.pop(h, None)
        self._unhold_unless_held(replica, h)

    def _drop_lower(self, replica: str, h: int, bit: int) -> None:
        lower = self._lower.get(replica)
        if lower and h in lower:
            lower[h] &= ~bit
            if not lower[h]:
                del lower[h]
        self._unhold_unless_held(replica, h)

    def _unhold_unless_held(self, replica: str, h: int) -> None:
        """replica let go of h on one tier: it leaves h's holders unless it holds h on another (or expects it)."""
        slot = self._slots.get(replica)
        if slot is None or h in self._confirmed.get(replica, ()) or h in self._expected.get(replica, ()) or \
                h in self._lower.get(replica, ()):
            return
        self._unhold(1 << slot, h)

    def _unhold(self, bit: int, h: int) -> None:
        mask = self._holders.get(h)
        if mask is not None:
            mask &= ~bit
            if mask:
                self._holders[h] = mask
            else:
                del self._holders[h]

    def _expire(self) -> None:
        now = self.clock()
        while self._deadlines and self._deadlines[0][0] <= now:
            deadline, replica, hashes = self._deadlines.popleft()
            expected = self._expected.get(replica)
            if not expected:
                continue
            for h in hashes:
                if expected.get(h) == deadline:  # not re-expected later, not confirmed since
                    del expected[h]
                    self._unhold_unless_held(replica, h)

    def check_integrity(self) -> None:
        """Raises ValueError unless holders == confirmed + expected + lower tiers, per hash and replica, and every
        replica with entries has a slot of its own."""
        derived: dict[int, int] = {}
        if any(not bits for lower in self._lower.values() for bits in lower.values()):
            raise ValueError("prefix index keeps a lower-tier entry with no tier")
        for source in (self._confirmed, self._expected, self._lower):
            for replica, hashes in source.items():
                if hashes and replica not in self._slots:
                    raise ValueError(f"replica {replica} has entries but no slot")
                for h in hashes:
                    derived[h] = derived.get(h, 0) | (1 << self._slots[replica])
        if derived != self._holders:
            raise ValueError("prefix index holders disagree with the per-replica sets")
        if any(self._names[slot] != name for name, slot in self._slots.items()):
            raise ValueError("prefix index slots disagree with their names")
