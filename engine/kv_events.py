"""KV cache events: what the prefix cache stored and removed, for the router's index of who holds which block.

Events carry block hashes (the chained content hashes of engine/prefix_cache.py), never block ids: a router
compares hashes across replicas. A sink is any callable taking one event; the engine calls it from its step loop,
so a sink must not block (queue the event and return).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Union


@dataclass(frozen=True)
class BlockStored:
    """A full block became reusable. parent_hash is the hash of the block before it (None for a first block);
    token_ids are the block's tokens; cache_salt is the tenant salt its hash includes (None: no salt)."""

    block_hash: int
    parent_hash: int | None
    token_ids: tuple[int, ...]
    cache_salt: str | None = None


@dataclass(frozen=True)
class BlockRemoved:
    """Cached blocks were evicted: a request arriving now would recompute them."""

    block_hashes: tuple[int, ...]


@dataclass(frozen=True)
class AllBlocksCleared:
    """The replica dropped its whole prefix cache (reset or restart): forget everything it published before."""


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
