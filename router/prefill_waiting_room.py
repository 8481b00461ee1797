"""Late binding's waiting room (step 0 of lifecycle.py, DriverSettings.prefill_queue_tokens > 0): requests whose
planned prefill replica already has `limit` uncached tokens queued wait here, holding nothing, in arrival order,
and are woken one at a time when a prefill replica's queue drops below the limit or the pool changes. Who waits
and how many uncached tokens they bring (num_waiting, waiting_tokens) is the prefill pool's backlog the
autoscaler reads. Mutated only on the router's event loop."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Callable, Sequence

from tandem.router.replicas import NoCapacityError, Replica
from tandem.router.routing import RoutePlan


class PrefillWaitingRoom:
    def __init__(self, limit: int):
        """limit: prefill_queue_tokens (0: late binding off, nobody waits)."""
        self.limit = limit
        self.num_waiting = 0
        self.waiting_tokens = 0
        self._turns: deque[asyncio.Future] = deque()  # in arrival order

    async def wait(self, plan: RoutePlan, replan: Callable[[], RoutePlan], *, queued: Callable[[], int],
                   max_queued: int, timeout_s: float) -> RoutePlan:
        """While the planned prefill replica has `limit` or more uncached tokens queued, waits here holding
        nothing (no decode reservation: a prefill backlog does not tie up decode room), in arrival order, and
        asks replan() for a new plan each time it is woken. Returns the plan to go with. Waits count against
        max_queued (with queued(): the requests waiting for decode room) and timeout_s like a wait for decode
        room: past either, NoCapacityError. replan's errors (no decode replica left) end the wait."""
        start = time.monotonic()
        seated = 0  # the tokens counted as waiting (0: not waiting yet)
        try:
            while plan.prefill is not None and plan.prefill.queued_prefill_tokens >= self.limit:
                if not seated:
                    if queued() + self.num_waiting >= max_queued:
                        raise NoCapacityError(f"every prefill replica has {self.limit} or more tokens queued and "
                                              f"{queued() + self.num_waiting} requests are already waiting")
                    seated = self.sit(plan.uncached_tokens)
                if not await self.turn(timeout_s - (time.monotonic() - start)):
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

    async def turn(self, timeout_s: float) -> bool:
        """Waits until woken (True) or timeout_s passed (False; a wake-up that came as it timed out is passed
        on to the next in line)."""
        woken = asyncio.get_running_loop().create_future()
        self._turns.append(woken)
        try:
            await asyncio.wait_for(woken, timeout_s)
            return True
        except asyncio.TimeoutError:
            if woken.done() and not woken.cancelled():
                self._pass_on()
            return False
        finally:
            if not woken.done() or woken.cancelled():
                self._forget(woken)

    def wake(self, prefill: Sequence[Replica]) -> None:
        """Wakes the longest-waiting request if a prefill replica's queue is below the limit or the prefill pool
        is empty (it plans again: it goes, or waits at the back). The one that goes calls this again, so a
        replica with room for several takes several."""
        if not self.limit or not self._turns:
            return
        if prefill and min(r.load.queued_prefill_tokens for r in prefill) >= self.limit:
            return
        self._pass_on()

    def _pass_on(self) -> None:
        while self._turns:
            woken = self._turns.popleft()
            if not woken.done():
                woken.set_result(None)
                return

    def _forget(self, woken: asyncio.Future) -> None:
        try:
            self._turns.remove(woken)
        except ValueError:
            pass
