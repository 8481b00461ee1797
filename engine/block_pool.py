"""A pool of fixed-size KV blocks, by id. Plain Python: it decides ownership, the KV cache holds the bytes.

This is the minimal allocator the single-sequence generator needs; reference counts, prefix caching and
eviction build on it.
"""

from __future__ import annotations

from collections import deque


class OutOfBlocksError(RuntimeError):
    """Raised by allocate() when fewer blocks are free than asked for; nothing is allocated then."""


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._in_use: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        """Takes `count` free blocks. Raises OutOfBlocksError (allocating none) if fewer are free."""
        if count > len(self._free):
            raise OutOfBlocksError(f"asked for {count} KV blocks, {len(self._free)} free of {self.num_blocks}")
        blocks = [self._free.popleft() for _ in range(count)]
        self._in_use.update(blocks)
        return blocks

    def free(self, blocks: list[int]) -> None:
        """Returns blocks to the pool. Raises ValueError on a block that is not in use (double free)."""
        for block in blocks:
            if block not in self._in_use:
                raise ValueError(f"block {block} is not in use (double free?)")
            self._in_use.remove(block)
            self._free.append(block)

    def check_integrity(self) -> None:
        """Raises ValueError if free + in use != total, or a block is free twice or both free and in use."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise ValueError("a block is on the free list twice")
        if free & self._in_use:
            raise ValueError(f"blocks both free and in use: {sorted(free & self._in_use)[:8]}")
        if len(free) + len(self._in_use) != self.num_blocks:
            raise ValueError(f"free {len(free)} + in use {len(self._in_use)} != total {self.num_blocks}")
