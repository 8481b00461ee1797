"""One reusable buffer per agent for messages in flight, carved first-fit into 64-byte-aligned slots.

Allocated (and, by UCX, registered) once and reused, instead of a fresh buffer per message. Plain Python
bookkeeping over offsets; the bytes are one numpy array.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

_ALIGN = 64


@dataclass(frozen=True)
class Slot:
    offset: int
    size: int
    view: np.ndarray  # uint8, the slot's bytes (or a one-off buffer when offset < 0)


class StagingPool:
    def __init__(self, nbytes: int):
        self.capacity = nbytes
        self.buffer = np.empty(nbytes, dtype=np.uint8)
        self._free: list[tuple[int, int]] = [(0, nbytes)]  # (offset, size), sorted by offset
        self.num_in_use = 0

    def acquire(self, nbytes: int) -> Slot | None:
        """A slot of at least nbytes, or None when no free run is large enough (try again later)."""
        size = -(-nbytes // _ALIGN) * _ALIGN
        for i, (offset, free) in enumerate(self._free):
            if free >= size:
                if free == size:
                    del self._free[i]
                else:
                    self._free[i] = (offset + size, free - size)
                self.num_in_use += 1
                return Slot(offset, size, self.buffer[offset:offset + nbytes])
        return None

    def release(self, slot: Slot) -> None:
        """Returns a slot (one-off buffers, offset < 0, are simply dropped). Adjacent free runs merge."""
        if slot.offset < 0:
            return
        self.num_in_use -= 1
        i = bisect.bisect(self._free, (slot.offset, slot.size))
        offset, size = slot.offset, slot.size
        if i < len(self._free) and self._free[i][0] == offset + size:
            size += self._free.pop(i)[1]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == offset:
            offset, size = self._free[i - 1][0], self._free[i - 1][1] + size
            self._free.pop(i - 1)
            i -= 1
        self._free.insert(i, (offset, size))

    @property
    def free_bytes(self) -> int:
        return sum(size for _, size in self._free)

    def check_integrity(self) -> None:
        """Raises ValueError if free runs overlap or leave the buffer, or if every slot is back but the free
        runs do not cover the whole buffer."""
        end = 0
        for offset, size in self._free:
            if offset < end or size <= 0 or offset + size > self.capacity:
                raise ValueError(f"bad free run ({offset}, {size})")
            end = offset + size
        if self.num_in_use == 0 and self._free != [(0, self.capacity)]:
            raise ValueError(f"no slot in use but free runs are {self._free[:4]}")
