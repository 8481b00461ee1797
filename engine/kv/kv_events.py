"""KV cache events: what the prefix cache stored and removed, for the router's index of who holds which block.

Events carry block hashes (the chained content hashes of engine/kv/prefix_cache.py), never block ids: a router
compares hashes across replicas. A sink is any callable taking one event; the engine calls it from its step loop,
so a sink must not block (queue the event and return).

Each event names the tier it happened on (engine/core/kv_tiers.py): the device pool ("device"), host memory
("host") or local disk ("disk"). A block may be on several tiers at once (a parked device block is copied to the
host before it is evicted), and leaves each with its own BlockRemoved.
"""

from __future__ import annotations

import itertools
import secrets
import threading
from collections import deque
from dataclasses import dataclass
from typing import Callable, Union

DEVICE, HOST, DISK = "device", "host", "disk"
TIERS = (DEVICE, HOST, DISK)


@dataclass(frozen=True)
class BlockStored:
    """A full block became reusable on `tier`. parent_hash is the hash of the block before it (None for a first
    block); token_ids are the block's tokens; cache_salt is the tenant salt its hash includes (None: no salt). A
    copy to a lower tier knows only its hash: its parent, tokens and salt are those its device store published."""

    block_hash: int
    parent_hash: int | None
    token_ids: tuple[int, ...]
    cache_salt: str | None = None
    tier: str = DEVICE


@dataclass(frozen=True)
class BlockRemoved:
    """Cached blocks left `tier`: a request arriving now finds them there no longer (maybe on another tier)."""

    block_hashes: tuple[int, ...]
    tier: str = DEVICE


@dataclass(frozen=True)
class AllBlocksCleared:
    """The replica dropped its whole prefix cache and tiers (restart): forget everything it published before."""


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]
KVEventSink = Callable[[KVEvent], None]


def discard_events(event: KVEvent) -> None:
    """The default sink, for engines nobody routes to."""


class KVEventRecorder:
    """A sink that keeps every event in order: for tests and for draining into a transport in batches."""

    def __init__(self) -> None:
        self.events: list[KVEvent] = []

    def __call__(self, event: KVEvent) -> None:
        self.events.append(event)

    def drain(self) -> list[KVEvent]:
        events, self.events = self.events, []
        return events


@dataclass(frozen=True)
class KVEventBatch:
    """Events first_seq, first_seq + 1, ... of the log whose epoch is `epoch`."""

    epoch: str
    first_seq: int
    events: tuple[KVEvent, ...]

    @property
    def next_seq(self) -> int:
        return self.first_seq + len(self.events)


@dataclass(frozen=True)
class KVSnapshot:
    """Every block hash the replica's prefix cache (block_hashes) and its KV tiers held once the log's first
    `next_seq` events had happened: a reader that lost its place starts over from here."""

    epoch: str
    next_seq: int
    block_hashes: tuple[int, ...]
    host_hashes: tuple[int, ...] = ()
    disk_hashes: tuple[int, ...] = ()


class KVEventLog:
    """A sink that numbers events and keeps the latest `capacity` of them for readers that poll (the router).

    The engine thread appends; any thread reads. A reader passes the epoch and sequence number it expects next;
    read() answers with the events since then, or None when the reader must resynchronize from a snapshot: the
    log was recreated (the replica restarted: a new epoch) or the events it missed have already been dropped.
    """

    def __init__(self, capacity: int = 65536, epoch: str | None = None):
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.epoch = epoch or secrets.token_hex(8)
        self._events: deque[KVEvent] = deque(maxlen=capacity)
        self._next_seq = 0
        self._lock = threading.Lock()

    def __call__(self, event: KVEvent) -> None:
        with self._lock:
            self._events.append(event)
            self._next_seq += 1

    @property
    def next_seq(self) -> int:
        return self._next_seq

    def read(self, epoch: str | None, since: int, limit: int = 4096) -> KVEventBatch | None:
        """At most `limit` events from sequence number `since` on; None if they cannot be given (see above)."""
        with self._lock:
            first_kept = self._next_seq - len(self._events)
            if epoch != self.epoch or not first_kept <= since <= self._next_seq:
                return None
            start = since - first_kept
            events = tuple(itertools.islice(self._events, start, min(start + limit, len(self._events))))
        return KVEventBatch(self.epoch, since, events)
