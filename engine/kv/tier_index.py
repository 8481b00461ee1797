"""Which prefix blocks a KV tier below the device pool holds (host memory, local disk), by block hash, in LRU order
within the tier's byte budget. Plain Python: the tier's storage (a host tensor of slots, a folder of files) holds
the bytes; this decides which block is where and which one leaves when room is needed.

A tier has capacity // block_bytes slots of one block each (every layer of the block together, K and V, with a
quantized cache's scale rows: what moves between tiers is one block's whole KV). An entry is in one of two states:
  ready    its bytes are in its slot; a lookup may read it (touch: most recently used);
  pinned   a copy into or out of its slot is in flight (pin count >= 1): it cannot be evicted, and until its
           first pin is released after a write (ready()) a lookup does not see it.
Eviction takes the least recently used ready, unpinned entry; admit() refuses (returns None) rather than evict a
pinned one. ready + writing (pinned before ready) == entries, each slot owned once: check_integrity().
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class Admission:
    """Where a newly admitted block goes (slot) and which blocks left the tier to make room (their hashes and the
    slots they freed, in eviction order): the caller moves those further down or drops them."""

    slot: int
    evicted: tuple[tuple[int, int], ...]  # (block hash, slot)


class TierIndex:
    """One tier's blocks. name: for messages ("host", "disk"); capacity_bytes and block_bytes: the tier's byte
    budget and one block's size (all its layers). Raises ValueError if the budget holds no block."""

    def __init__(self, name: str, capacity_bytes: int, block_bytes: int):
        if block_bytes < 1:
            raise ValueError(f"a KV block has at least one byte, got {block_bytes}")
        self.name = name
        self.block_bytes = block_bytes
        self.num_slots = capacity_bytes // block_bytes
        if self.num_slots < 1:
            raise ValueError(f"the {name} tier's {capacity_bytes} bytes hold no KV block of {block_bytes} bytes")
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # hash -> slot, least recently used first
        self._pins: dict[int, int] = {}  # hash -> copies in flight
        self._writing: set[int] = set()  # admitted, bytes not yet in the slot
        self._free = list(range(self.num_slots - 1, -1, -1))  # a stack: slot 0 first

    def __len__(self) -> int:
        return len(self._slot_of)

    @property
    def bytes_used(self) -> int:
        return len(self._slot_of) * self.block_bytes

    def __contains__(self, block_hash: int) -> bool:
        """Whether the block is here and readable (written)."""
        return block_hash in self._slot_of and block_hash not in self._writing

    def lookup(self, block_hash: int) -> int | None:
        """The slot of a readable block, made the most recently used; None if it is not here (or still being
        written)."""
        if block_hash not in self:
            return None
        self._slot_of.move_to_end(block_hash)
        return self._slot_of[block_hash]

    def match(self, hashes: list[int]) -> int:
        """How many of `hashes`, from the first, are readable here (the run a prefix lookup can copy back)."""
        count = 0
        for h in hashes:
            if h not in self:
                break
            count += 1
        return count

    def admit(self, block_hash: int) -> Admission | None:
        """Takes a slot for a block about to be written into it (the entry is pinned, unreadable until ready()),
        evicting least recently used ready blocks if the tier is full. Returns None, changing nothing, when the
        block is here already or every slot is pinned. The caller writes the slot, then calls ready()."""
        if block_hash in self._slot_of:
            return None
        evicted: list[tuple[int, int]] = []
        if not self._free:
            victim = next((h for h in self._slot_of if h not in self._pins), None)
            if victim is None:
                return None
            slot = self._slot_of.pop(victim)
            evicted.append((victim, slot))
            self._free.append(slot)
        slot = self._free.pop()
        self._slot_of[block_hash] = slot
        self._pins[block_hash] = 1
        self._writing.add(block_hash)
        return Admission(slot, tuple(evicted))

    def ready(self, block_hash: int) -> None:
        """The write admit() started is done: the block becomes readable and its pin is released. Raises
        ValueError for a block not being written."""
        if block_hash not in self._writing:
            raise ValueError(f"{self.name} tier: block {block_hash:#x} is not being written")
        self._writing.discard(block_hash)
        self.unpin(block_hash)

    def pin(self, block_hash: int) -> int:
        """Holds a readable block while it is copied out (not evictable until unpin). Returns its slot. Raises
        KeyError if it is not readable here."""
        if block_hash not in self:
            raise KeyError(f"{self.name} tier: block {block_hash:#x} is not here")
        self._pins[block_hash] = self._pins.get(block_hash, 0) + 1
        return self._slot_of[block_hash]

    def unpin(self, block_hash: int) -> None:
        """Releases one pin. Raises ValueError for a block with none."""
        pins = self._pins.get(block_hash, 0)
        if pins < 1:
            raise ValueError(f"{self.name} tier: block {block_hash:#x} is not pinned")
        if pins == 1:
            del self._pins[block_hash]
        else:
            self._pins[block_hash] = pins - 1

    def remove(self, block_hash: int) -> int | None:
        """Drops a block that is not pinned (a failed write's, a corrupt file's) and returns its freed slot; None
        if it is not here. Raises ValueError if it is pinned by a reader."""
        if block_hash not in self._slot_of:
            return None
        pins = self._pins.get(block_hash, 0)
        if pins > (1 if block_hash in self._writing else 0):
            raise ValueError(f"{self.name} tier: block {block_hash:#x} is being read")
        self._pins.pop(block_hash, None)
        self._writing.discard(block_hash)
        slot = self._slot_of.pop(block_hash)
        self._free.append(slot)
        return slot

    def hashes(self) -> tuple[int, ...]:
        """Every readable block's hash, least recently used first (for KV events and snapshots)."""
        return tuple(h for h in self._slot_of if h not in self._writing)

    def check_integrity(self) -> None:
        """Raises ValueError unless every slot is owned by one block or free, exactly once, pins are positive and
        belong to blocks here, and every block being written is pinned."""
        owned = list(self._slot_of.values())
        if len(set(owned)) != len(owned):
            raise ValueError(f"{self.name} tier: a slot holds two blocks")
        if set(owned) & set(self._free) or len(set(self._free)) != len(self._free):
            raise ValueError(f"{self.name} tier: a slot is both free and owned, or free twice")
        if len(owned) + len(self._free) != self.num_slots:
            raise ValueError(f"{self.name} tier: {len(owned)} owned + {len(self._free)} free != {self.num_slots}")
        if bad := [h for h, n in self._pins.items() if n < 1 or h not in self._slot_of]:
            raise ValueError(f"{self.name} tier: stray pins on {bad[:4]}")
        if bad := [h for h in self._writing if h not in self._pins]:
            raise ValueError(f"{self.name} tier: blocks being written without a pin: {bad[:4]}")
