"""Requests waiting at the router, in a pool's scheduler order (engine/core/scheduling_policy.py, as the pool's
`scheduler.policy` says): the prefill waiting room (late binding) and the wait for decode room both keep their
waiters here. fcfs by arrival; priority by priority, then arrival; sjf by size (what the waiter passes: uncached
prompt tokens for a prefill, (max_tokens, prompt tokens) for decode room), arrival once one waited sjf_aging_s;
fair by start tags over the waiter's cost and its tenant's weight (FairShare, the engine's). Plain Python on the
router's event loop, clock injected."""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass
from typing import Any, Callable

from tandem.engine.core.scheduling_policy import FairShare, order_key
from tandem.engine.engine_config import SchedulingConfig


@dataclass(eq=False)
class Place:
    """One waiter's place in a PolicyQueue. woken: what its owner waits on, if anything."""

    arrival: int
    since: float  # when it started waiting (the queue's clock)
    priority: int
    size: tuple[int, ...]
    tag: float  # fair: its start tag
    woken: Any = None


class PolicyQueue:
    def __init__(self, scheduling: SchedulingConfig = SchedulingConfig(), *,
                 clock: Callable[[], float] = time.monotonic):
        self.scheduling, self.clock = scheduling, clock
        self._places: list[Place] = []
        self._arrivals = itertools.count()
        self._fair = FairShare(scheduling)

    def __len__(self) -> int:
        return len(self._places)

    def place(self, *, tenant: str | None, priority: int, size: tuple[int, ...], cost: float) -> Place:
        """A new waiter's place, not queued yet (add() queues it; it may be added and removed again, keeping its
        place in the order)."""
        tag = self._fair.tag(tenant, cost) if self.scheduling.policy == "fair" else 0.0
        return Place(next(self._arrivals), self.clock(), priority, size, tag)

    def add(self, place: Place) -> None:
        self._places.append(place)

    def remove(self, place: Place) -> None:
        """Takes place out (if it is in)."""
        self._places = [p for p in self._places if p is not place]

    def first(self) -> Place | None:
        """The waiter first in order now (None: nobody waits)."""
        return min(self._places, key=self._order) if self._places else None

    def started(self, place: Place) -> None:
        """place's waiter goes on (fair: the virtual time moves to its start tag)."""
        if self.scheduling.policy == "fair":
            self._fair.started(place.tag)

    def _order(self, place: Place) -> tuple:
        aged = self.clock() - place.since >= self.scheduling.sjf_aging_s
        return order_key(self.scheduling.policy, arrival=(place.arrival,), priority=place.priority, size=place.size,
                         tag=place.tag, aged=aged)


class DecodeRoom:
    """Lifecycle step 1's wait for decode room (router/lifecycle.py): a request no decode replica had room for
    waits here in the decode pool's order (sjf: fewest max_tokens, then prompt tokens; fair: by its prompt plus
    max_tokens), and only the first in order asks the replicas again, every retry interval; the others would be
    refused as it was, and must not take the room it waits for."""

    def __init__(self, scheduling: SchedulingConfig = SchedulingConfig()):
        self.queue = PolicyQueue(scheduling)

    def __len__(self) -> int:
        return len(self.queue)

    def join(self, *, tenant: str | None, priority: int, prompt_tokens: int, max_tokens: int) -> Place:
        place = self.queue.place(tenant=tenant, priority=priority, size=(max_tokens, prompt_tokens),
                                 cost=prompt_tokens + max_tokens)
        self.queue.add(place)
        return place

    async def next_try(self, place: Place, interval_s: float, deadline: float) -> None:
        """Returns once place is first in order, after interval_s (at once when the one before it leaves: room it
        found may be there for the next too), or once the monotonic deadline has passed."""
        while True:
            place.woken = asyncio.Event()
            try:
                await asyncio.wait_for(place.woken.wait(), interval_s)
            except asyncio.TimeoutError:
                pass
            if self.queue.first() is place or time.monotonic() >= deadline:
                return

    def leave(self, place: Place) -> None:
        """place is done waiting (it has room, or gave up): the next in order asks at once."""
        self.queue.remove(place)
        self.queue.started(place)
        if (first := self.queue.first()) is not None and first.woken is not None:
            first.woken.set()
