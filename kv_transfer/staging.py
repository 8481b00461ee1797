"""One reusable buffer per agent for messages in flight, carved first-fit into 64-byte-aligned slots.

Allocated (and, by UCX, registered) once and reused, instead of a fresh buffer per message. Plain Python
bookkeeping over offsets; the bytes are one host array (numpy; pinned memory beside a CUDA KV store) and, for
transports that send device memory themselves, a device buffer of the same size carved at the same offsets
(the host bytes then mirror a message for its header and MAC). The allocators come from the caller.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Callable

import numpy as np

_ALIGN = 64


def _numpy_bytes(nbytes: int) -> np.ndarray:
    return np.empty(nbytes, dtype=np.uint8)


@dataclass(frozen=True)
class Slot:
    offset: int
    size: int
    view: np.ndarray  # uint8, the slot's host bytes (or a one-off buffer when offset < 0)
    device: object = None  # the slot's bytes on the device (a uint8 torch tensor) when the pool has them

    @property
    def wire(self):
        """What the transport sends from or receives into: the device bytes when there are any."""
        return self.view if self.device is None else self.device


class StagingPool:
    def __init__(self, nbytes: int, host: Callable[[int], np.ndarray] = _numpy_bytes,
                 device: Callable[[int], object] | None = None, buffer: np.ndarray | None = None):
        """host(n) / device(n) allocate n bytes (uint8, sliceable); without device, slots are host bytes only.
        buffer: the pool's host bytes, allocated by the caller (shared memory), instead of host(nbytes)."""
        self.capacity = nbytes
        self._host, self._device = host, device
        self.buffer = host(nbytes) if buffer is None else buffer[:nbytes]
        self.device_buffer = device(nbytes) if device is not None else None
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
                on_device = None if self.device_buffer is None else self.device_buffer[offset:offset + nbytes]
                return Slot(offset, size, self.buffer[offset:offset + nbytes], on_device)
        return None

    def one_off(self, nbytes: int) -> Slot:
        """A slot outside the pool (offset -1), with the pool's kinds of memory: for a message that found the
        pool full. Releasing it just drops it."""
        return Slot(-1, nbytes, self._host(nbytes), None if self._device is None else self._device(nbytes))

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
