"""Late binding's waiting room (step 0 of lifecycle.py, DriverSettings.prefill_queue_tokens > 0): requests whose
planned prefill replica already has `limit` uncached tokens queued wait here, holding nothing, and are woken one
at a time when a prefill replica's queue drops below the limit or the pool changes, in the order of the prefill
pool's scheduler policy (DriverSettings.waiting_room; router/policy_queue.py: sjf by uncached tokens, fair by
start tags over them). Who waits and how many uncached tokens they bring (num_waiting,
waiting_tokens) is the prefill pool's backlog the autoscaler reads. Mutated only on the router's event loop."""

from __future__ import annotations

import asyncio
import time
from typing import Callable, Sequence

from tandem.engine.engine_config import SchedulingConfig
from tandem.router.policy_queue import Place, PolicyQueue
from tandem.router.replicas import NoCapacityError, Replica
from tandem.router.routing import RoutePlan


class PrefillWaitingRoom:
    def __init__(self, limit: int, scheduling: SchedulingConfig = SchedulingConfig(), *,
                 clock: Callable[[], float] = time.monotonic):
        """limit: prefill_queue_tokens (0: late binding off, nobody waits). scheduling: the order it wakes in."""
        self.limit = limit
        self.num_waiting = 0
        self.waiting_tokens = 0
        self._turns = PolicyQueue(scheduling, clock=clock)

    async def wait(self, plan: RoutePlan, replan: Callable[[], RoutePlan], *, queued: Callable[[], int],
                   max_queued: int, timeout_s: float, tenant: str | None = None, priority: int = 0) -> RoutePlan:
        """While the planned prefill replica has `limit` or more uncached tokens queued, waits here holding
        nothing (no decode reservation: a prefill backlog does not tie up decode room), in the policy's order,
        and asks replan() for a new plan each time it is woken. Returns the plan to go with. Waits count against
        max_queued (with queued(): the requests waiting for decode room) and timeout_s like a wait for decode
        room: past either, NoCapacityError. replan's errors (no decode replica left) end the wait. tenant, priority:
        the request's (its place in the order, kept across turns)."""
        start = time.monotonic()
        seated = 0  # the tokens counted as waiting (0: not waiting yet)
        place: Place | None = None
        try:
            while plan.prefill is not None and plan.prefill.queued_prefill_tokens >= self.limit:
                if not seated:
                    if queued() + self.num_waiting >= max_queued:
                        raise NoCapacityError(f"every prefill replica has {self.limit} or more tokens queued and "
                                              f"{queued() + self.num_waiting} requests are already waiting")
                    seated = self.sit(plan.uncached_tokens)
                    place = self._turns.place(tenant=tenant, priority=priority, size=(seated,), cost=seated)
                if not await self.turn(timeout_s - (time.monotonic() - start), place):
                    raise NoCapacityError(f"no prefill replica had fewer than {self.limit} tokens queued within "
                                          f"{timeout_s:g} s")
                plan = replan()
        finally:
            if seated:
                self.leave(seated)
        return plan

    def sit(self, tokens: int) -> int:
        """Counts a request as waiting with its uncached tokens (at least 1); returns what to give leave()."""
        tokens = max(1, tokens)
        self.num_waiting += 1
        self.waiting_tokens += tokens
        return tokens

    def leave(self, tokens: int) -> None:
        self.num_waiting -= 1
        self.waiting_tokens -= tokens

    async def turn(self, timeout_s: float, place: Place) -> bool:
        """Waits in place until woken (True) or timeout_s passed (False; a wake-up that came as it timed out is
        passed on to the next in line)."""
        woken = place.woken = asyncio.get_running_loop().create_future()
        self._turns.add(place)
        try:
            await asyncio.wait_for(woken, timeout_s)
            return True
        except asyncio.TimeoutError:
            if woken.done() and not woken.cancelled():
                self._pass_on()
            return False
        finally:
            if not woken.done() or woken.cancelled():
                self._turns.remove(place)

    def wake(self, prefill: Sequence[Replica]) -> None:
        """Wakes the first request in order if a prefill replica's queue is below the limit or the prefill pool
        is empty (it plans again: it goes, or waits again in its place). The one that goes calls this again, so
        a replica with room for several takes several."""
        if not self.limit or not len(self._turns):
            return
        if prefill and min(r.load.queued_prefill_tokens for r in prefill) >= self.limit:
            return
        self._pass_on()

    def _pass_on(self) -> None:
        while (first := self._turns.first()) is not None:
            self._turns.remove(first)
            if not first.woken.done():
                self._turns.started(first)
                first.woken.set_result(None)
                return
