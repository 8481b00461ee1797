"""Keeps the router's prefix indexes and load counters fed: polls every replica's kv_events()
(ReplicaAPI.kv_events: its KV event log and free KV blocks) and applies the answers.

Each replica has a cursor: the epoch of its event log and the sequence number expected next. An answer whose
batch does not start at the cursor is a gap (a lost answer, a log that moved on): the cursor is cleared and the
next poll asks for a snapshot. A snapshot (a restarted replica, or a cursor older than what the log keeps)
replaces what the index believed about the replica. A replica that fails to answer keeps its entries until it
answers or leaves the pool; routing to it only risks a miss.

A replica whose last answers brought nothing new is polled less often: one with nothing in flight from this
router up to every 16 intervals, so that an idle cluster of many replicas costs the router little; one with
requests in flight up to every 4 intervals. A poll costs the router and the replica a Ray call each, and on a
small machine both share the cores that compute tokens: at batch 1 a replica decoding one token per 40 ms
publishes an event only when a block fills (every block_size tokens), and polling it every 50 ms cost the
router about 1.2 ms of CPU per token. A request that ends on a replica (nudge) makes it due at the next round,
so what the request left in its prefix cache is known before the client's next turn.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Callable, Iterable

from tandem.engine.kv.kv_events import KVEventBatch, KVSnapshot
from tandem.replica.contract import KVEventsReply
from tandem.router.kv_index import PrefixIndex
from tandem.router.policy import ReplicaLoad
from tandem.router.replicas import Replica

_log = logging.getLogger(__name__)


MAX_BACKOFF = 16  # intervals between polls of a quiet replica, at most
IN_FLIGHT_MAX_BACKOFF = 4  # ... of a replica with requests in flight whose answers bring nothing new


@dataclass
class FeedCursor:
    epoch: str | None = None  # None: ask for a snapshot
    next_seq: int = 0
    quiet: int = 0  # answers in a row that brought nothing new
    polled: float = float("-inf")  # monotonic time of the last poll (-inf: due at the next round)


@dataclass
class FeedCounters:
    batches: int = 0
    events: int = 0
    snapshots: int = 0
    gaps: int = 0
    poll_failures: int = 0


class KVFeed:
    def __init__(self, indexes: dict[str, PrefixIndex], *, clock: Callable[[], float] = time.monotonic):
        """indexes: pool name -> that pool's index."""
        self.indexes = indexes
        self.clock = clock
        self.cursors: dict[str, FeedCursor] = {}
        self.counters = FeedCounters()

    def apply(self, pool: str, load: ReplicaLoad, reply: KVEventsReply) -> None:
        """Applies one kv_events() answer from the replica whose load record is `load`."""
        cursor = self.cursors.setdefault(load.name, FeedCursor())
        batch = reply.events
        index = self.indexes[pool]
        if isinstance(batch, KVSnapshot):
            index.apply_snapshot(load.name, batch.block_hashes, batch.host_hashes, batch.disk_hashes)
            cursor.epoch, cursor.next_seq = batch.epoch, batch.next_seq
            self.counters.snapshots += 1
        elif isinstance(batch, KVEventBatch):
            if batch.epoch != cursor.epoch or batch.first_seq != cursor.next_seq:
                _log.info("replica %s: KV events out of step (%s:%d, expected %s:%d); resynchronizing",
                          load.name, batch.epoch, batch.first_seq, cursor.epoch, cursor.next_seq)
                cursor.epoch = None
                self.counters.gaps += 1
            else:
                index.apply(load.name, batch.events)
                cursor.next_seq = batch.next_seq
                self.counters.batches += 1
                self.counters.events += len(batch.events)
                cursor.quiet = cursor.quiet + 1 if not batch.events else 0
        else:
            raise TypeError(f"replica {load.name} answered kv_events with a {type(batch).__name__}")
        if load.refusals and load.kv_blocks_free is not None and reply.kv_blocks_free > load.kv_blocks_free:
            load.refusals = 0  # room came back since it refused: rank it by its load again, not last
        load.kv_blocks_free = reply.kv_blocks_free
        if reply.tier_hit_costs is not None:
            load.tier_hit_costs = reply.tier_hit_costs
        if reply.prefill_tokens_per_s is not None:
            load.prefill_tokens_per_s = reply.prefill_tokens_per_s

    def forget(self, name: str) -> None:
        self.cursors.pop(name, None)

    def nudge(self, name: str) -> None:
        """A request ended on replica `name`: poll it at the next round, whatever its backoff."""
        cursor = self.cursors.get(name)
        if cursor is not None:
            cursor.quiet, cursor.polled = 0, float("-inf")

    def _due(self, cursor: FeedCursor, in_flight: bool, now: float, interval_s: float) -> bool:
        backoff = min(2 ** cursor.quiet, IN_FLIGHT_MAX_BACKOFF if in_flight else MAX_BACKOFF)
        return now >= cursor.polled + interval_s * backoff

    async def poll(self, replicas: Iterable[Replica], interval_s: float = 0.0) -> None:
        """One round: asks every replica for its events concurrently and applies the answers; a quiet replica is
        skipped until its backoff (in units of interval_s) has passed."""
        now = self.clock()
        due = []
        for replica in replicas:
            cursor = self.cursors.setdefault(replica.name, FeedCursor())
            if self._due(cursor, bool(replica.load.in_flight), now, interval_s):
                cursor.polled = now
                due.append(replica)

        async def ask(replica: Replica) -> None:
            cursor = self.cursors.get(replica.name)
            if cursor is None:  # it left its pool since this round began
                return
            try:
                reply = await replica.api.kv_events(cursor.epoch, cursor.next_seq)
            except Exception as e:  # a dead replica is noticed by the requests it serves
                self.counters.poll_failures += 1
                _log.debug("kv_events of %s failed: %r", replica.name, e)
                return
            if self.cursors.get(replica.name) is cursor:  # else it left meanwhile: its answer would re-index it
                self.apply(replica.pool, replica.load, reply)

        await asyncio.gather(*(ask(r) for r in due))

    async def run(self, replicas: Callable[[], Iterable[Replica]], interval_s: float) -> None:
        """Polls every interval_s until cancelled. replicas() gives the replicas routed to now."""
        while True:
            try:
                await self.poll(replicas(), interval_s)
            except Exception:  # a malformed answer must not stop the feed for every replica
                _log.exception("KV feed round failed")
            await asyncio.sleep(interval_s)
