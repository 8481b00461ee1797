"""A pool of fixed-size KV blocks, by id, with reference counts. Plain Python: it decides ownership, the KV
cache tensor holds the bytes.

Every block is in exactly one of three states:
  free    no owner, content meaningless; handed out first by allocate(), most recently freed first (its
          memory is likely still in the CPU caches and already paged in).
  parked  no owner, but its content is a cached prefix block that a later request may reuse (incref brings it
          back); parked blocks are kept in least-recently-released order and evicted oldest first.
  in use  ref_count >= 1 owners (several when a prefix or a forked prompt is shared).
free + parked + in use == num_blocks always; check_integrity() verifies it.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable


class OutOfBlocksError(RuntimeError):
    """Raised by allocate() when fewer blocks are free than asked for; nothing is allocated then."""


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # a stack: block 0 is taken first
        self._parked: OrderedDict[int, None] = OrderedDict()  # oldest release first
        self._refs: dict[int, int] = {}  # blocks in use -> owner count

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_parked(self) -> int:
        return len(self._parked)

    @property
    def num_in_use(self) -> int:
        return len(self._refs)

    @property
    def num_available(self) -> int:
        """Blocks an allocation can get: free ones plus parked ones it may evict."""
        return len(self._free) + len(self._parked)

    def ref_count(self, block: int) -> int:
        """Owners of a block (0 when free or parked)."""
        return self._refs.get(block, 0)

    def is_parked(self, block: int) -> bool:
        return block in self._parked

    def allocate(self, count: int) -> list[int]:
        """Takes `count` free blocks, each with one owner. Parked blocks are not touched: evict them first.
        Raises OutOfBlocksError (allocating none) if fewer than `count` are free."""
        if count > len(self._free):
            raise OutOfBlocksError(f"asked for {count} KV blocks, {len(self._free)} free of {self.num_blocks}")
        blocks = [self._free.pop() for _ in range(count)]
        for block in blocks:
            self._refs[block] = 1
        return blocks

    def incref(self, block: int) -> None:
        """Adds an owner to a block in use, or takes a parked block back into use with one owner.
        Raises ValueError for a free block (its content is gone)."""
        if block in self._refs:
            self._refs[block] += 1
        elif block in self._parked:
            del self._parked[block]
            self._refs[block] = 1
        else:
            raise ValueError(f"block {block} is free; only blocks in use or parked can gain an owner")

    def decref(self, block: int, *, park: bool) -> int:
        """Drops one owner and returns the owners left. A block left with none is parked (newest end of the
        eviction order) when `park`, else freed. Raises ValueError for a block not in use (double free)."""
        refs = self._refs.get(block)
        if refs is None:
            raise ValueError(f"block {block} is not in use (double free?)")
        if refs > 1:
            self._refs[block] = refs - 1
            return refs - 1
        del self._refs[block]
        if park:
            self._parked[block] = None
        else:
            self._free.append(block)
        return 0

    def evict(self, count: int) -> list[int]:
        """Frees the `count` least recently parked blocks and returns them (the caller forgets their hashes).
        Raises ValueError if fewer are parked."""
        if count > len(self._parked):
            raise ValueError(f"asked to evict {count} blocks, only {len(self._parked)} are parked")
        victims = [self._parked.popitem(last=False)[0] for _ in range(count)]
        self._free.extend(victims)
        return victims

    def evict_all(self) -> list[int]:
        return self.evict(len(self._parked))

    def blocks_in_use(self) -> Iterable[int]:
        return self._refs.keys()

    def check_integrity(self) -> None:
        """Raises ValueError unless free + parked + in use == total, each block in one state once, every
        in-use block has at least one owner and every id is in range."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise ValueError("a block is on the free list twice")
        parked, in_use = set(self._parked), set(self._refs)
        for name_a, a, name_b, b in (("free", free, "parked", parked), ("free", free, "in use", in_use),
                                     ("parked", parked, "in use", in_use)):
            if a & b:
                raise ValueError(f"blocks both {name_a} and {name_b}: {sorted(a & b)[:8]}")
        if len(free) + len(parked) + len(in_use) != self.num_blocks:
            raise ValueError(f"free {len(free)} + parked {len(parked)} + in use {len(in_use)} "
                             f"!= total {self.num_blocks}")
        if bad := [b for b, r in self._refs.items() if r < 1]:
            raise ValueError(f"blocks in use with no owner: {bad[:8]}")
        if bad := [b for b in free | parked | in_use if not 0 <= b < self.num_blocks]:
            raise ValueError(f"block ids out of range: {bad[:8]}")
