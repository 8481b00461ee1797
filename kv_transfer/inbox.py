"""The receiving end of a transfer agent's transport: takes every arrived message off the wire without trusting
it, and hands the agent only messages whose MAC checked out.

Per pump turn, in three steps (the agent holds its lock for the first and the last only):
  1. post() (under the lock): for each arrived DATA message, asks the agent how long a message under its
     transfer key may be (room(key): None for a transfer it neither holds nor remembers). A message that fits
     is received into a staging slot; one that is too short, too long, or for an unknown transfer is drained
     into a small scratch buffer (the transport fails such a receive as truncated and writes nothing past the
     buffer), so no peer decides what is allocated here. A staging pool with no room leaves DATA messages
     queued until a slot frees up. ACK and ABORT messages of the right length are received into their own
     small buffers; other lengths, and tags of kinds we do not know, are drained. Nothing waits: receives
     still running are finished on a later turn.
  2. open() (without the lock): a finished receive is checked (the MAC, then the fields; a device-side slot is
     first copied to its host mirror) and returned as a DataMessage or ControlMessage, or dropped and counted.
  3. release() (under the lock): a finished receive's slot goes back to the pool.
Every drop is counted in the agent's DropCounter (kv_transfer/drops.py) by reason.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from tandem.kv_transfer.drops import DropCounter
from tandem.kv_transfer.staging import Slot, StagingPool
from tandem.kv_transfer.transport import Handle, Probe, Transport
from tandem.kv_transfer.wire import (HEADER_BYTES, INDEX_MASK, KEY_SHIFT, KIND_MASK, KIND_SHIFT, OTHER_KINDS,
                                     STATUS_BYTES, TAG_MASK, DataHeader, ForgedMessage, Kind, MalformedMessage,
                                     MessageKey, StatusMessage, make_tag)

DRAIN_BYTES = 64  # what a drained message may write into: less than any header, so nothing of it is read
SWEEP_INTERVAL_S = 0.05  # how often tags of unknown kinds are looked for


@dataclass(frozen=True)
class DataMessage:
    """An authentic DATA message: its transfer key, the index its tag carries, its header, and the staging slot
    holding header + payload (the agent reads the payload from it; release() gives it back)."""

    key: int
    index: int
    header: DataHeader
    slot: Slot


@dataclass(frozen=True)
class ControlMessage:
    """An authentic ACK or ABORT for the transfer under key."""

    key: int
    kind: Kind
    message: StatusMessage


@dataclass(frozen=True, eq=False)
class Received:
    """A receive the inbox posted: into a staging slot (DATA) or a small host buffer (ACK, ABORT)."""

    handle: Handle
    tag: int
    slot: Slot | None = None
    buffer: np.ndarray | None = None


class Inbox:
    def __init__(self, transport: Transport, key: MessageKey, staging: StagingPool, drops: DropCounter,
                 to_host: Callable[[object, np.ndarray], None], *, clock: Callable[[], float] = time.monotonic):
        """staging: the agent's pool (acquired from and released to under the agent's lock only). to_host(device,
        host): copies a device-side slot's bytes into its host mirror."""
        self.transport, self.key, self.staging = transport, key, staging
        self.drops, self.to_host, self.clock = drops, to_host, clock
        self._posted: list[Received] = []
        self._draining: list[tuple[Handle, np.ndarray]] = []  # buffers kept alive until the transport is done
        self._next_sweep = 0.0

    # -- step 1, under the agent's lock -----------------------------------------------------------------------

    def post(self, room: Callable[[int], int | None]) -> bool:
        """Posts receives for what has arrived (see the module docstring). room(key): the most bytes (header
        included) a DATA message of that transfer may have, None for a transfer the agent does not know.
        Returns whether anything was taken off the wire."""
        busy = self._post_data(room)
        busy |= self._post_control()
        if (now := self.clock()) >= self._next_sweep:
            self._next_sweep = now + SWEEP_INTERVAL_S
            busy |= self._sweep_other_kinds()
        self._draining = [(h, b) for h, b in self._draining if not h.done()]
        return busy

    def _post_data(self, room: Callable[[int], int | None]) -> bool:
        taken = False
        while (probe := self.transport.probe(make_tag(0, Kind.DATA, 0), KIND_MASK)) is not None:
            limit = room(probe.tag >> KEY_SHIFT)
            if probe.length < HEADER_BYTES:
                self._drain(probe, "malformed", f"a DATA message of {probe.length} bytes")
            elif limit is None:
                self._drain(probe, "unknown_transfer", f"DATA under tag {probe.tag:#x}")
            elif probe.length > limit:
                self._drain(probe, "oversized", f"a DATA message of {probe.length} bytes under tag {probe.tag:#x}, "
                                                f"at most {limit} fit its reservation")
            else:
                slot = self.staging.acquire(probe.length)
                if slot is None:
                    break  # staging full: the message waits until a slot frees up
                self._posted.append(Received(self.transport.receive(probe, slot.wire), probe.tag, slot=slot))
            taken = True
        return taken

    def _post_control(self) -> bool:
        taken = False
        for kind in (Kind.ACK, Kind.ABORT):
            while (probe := self.transport.probe(make_tag(0, kind, 0), KIND_MASK)) is not None:
                if probe.length != STATUS_BYTES:
                    self._drain(probe, "malformed", f"a {kind.name} message of {probe.length} bytes")
                else:
                    buffer = np.empty(STATUS_BYTES, dtype=np.uint8)
                    self._posted.append(Received(self.transport.receive(probe, buffer), probe.tag, buffer=buffer))
                taken = True
        return taken

    def _sweep_other_kinds(self) -> bool:
        taken = False
        for tag, mask in OTHER_KINDS:
            while (probe := self.transport.probe(tag, mask)) is not None:
                kind = (probe.tag >> KIND_SHIFT) & 0xF
                self._drain(probe, "malformed", f"a message of unknown kind {kind} ({probe.length} bytes)")
                taken = True
        return taken

    def _drain(self, probe: Probe, reason: str, detail: str) -> None:
        """Takes the message off the wire into DRAIN_BYTES (a longer one fails as truncated: nothing is read)."""
        self.drops.count(reason, detail)
        scratch = np.empty(DRAIN_BYTES, dtype=np.uint8)
        self._draining.append((self.transport.receive(probe, scratch), scratch))

    def finished(self) -> list[Received]:
        """Posted receives that are done; they stay counted in slots_in_flight until release()."""
        return [r for r in self._posted if r.handle.done()]

    # -- step 2, without the lock -----------------------------------------------------------------------------

    def open(self, received: Received) -> DataMessage | ControlMessage | None:
        """The authentic message a finished receive holds, or None (dropped and counted). Runs on the pump
        thread only (it alone touches a posted receive's bytes)."""
        key, kind, index = received.tag >> KEY_SHIFT, Kind((received.tag >> KIND_SHIFT) & 0xF), \
            received.tag & INDEX_MASK
        if (error := received.handle.error()) is not None:
            self.drops.count("malformed", f"{kind.name} under tag {received.tag:#x} did not arrive whole: {error}")
            return None
        try:
            if received.slot is None:
                return ControlMessage(key, kind, StatusMessage.open(self.key, received.tag, received.buffer))
            slot = received.slot
            if slot.device is not None:  # a device-side slot: its header and MAC are read from a host copy
                self.to_host(slot.device, slot.view)
            return DataMessage(key, index, DataHeader.open(self.key, received.tag, slot.view), slot)
        except ForgedMessage as e:
            self.drops.count("forged", f"{kind.name}: {e}")
        except MalformedMessage as e:
            self.drops.count("malformed", f"{kind.name} under tag {received.tag:#x}: {e}")
        return None

    # -- step 3, under the agent's lock -----------------------------------------------------------------------

    def release(self, received: Received) -> None:
        """Forgets a finished receive and gives its slot back."""
        self._posted.remove(received)
        if received.slot is not None:
            self.staging.release(received.slot)

    @property
    def slots_in_flight(self) -> int:
        """Staging slots held by posted receives (for the agent's check_integrity)."""
        return sum(1 for r in self._posted if r.slot is not None and r.slot.offset >= 0)

    def arriving(self, key: int) -> bool:
        """Whether a DATA message under key is queued in the transport or being received."""
        data = make_tag(key, Kind.DATA, 0)
        return (any(r.tag & ~INDEX_MASK == data for r in self._posted)
                or self.transport.probe(data, ~INDEX_MASK & TAG_MASK) is not None)

    @property
    def busy(self) -> bool:
        """Whether receives are still posted or draining."""
        return bool(self._posted or self._draining)
