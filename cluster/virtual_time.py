"""An asyncio event loop on virtual time, for tests and simulations of code that sleeps on the loop's clock (the
autoscaling loops, the batching mock replicas; tests/cluster/test_autoscaling.py, bench/autoscale.py): whenever
nothing is ready to run, time jumps to the next timer instead of waiting for it, so minutes of simulated load take
as long as their computation. Nothing else changes: callbacks run in the same order as on a real loop, and a loop
with nothing scheduled at all still waits for real I/O (threads that call back with call_soon_threadsafe). While
it runs, time.monotonic() reads the loop's virtual clock too, so code that stamps times with it (the router's
request driver) agrees with code that sleeps on the loop.

    result = run_virtual(main())
"""

from __future__ import annotations

import asyncio
import time
from typing import Awaitable, TypeVar

T = TypeVar("T")


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self):
        super().__init__()
        self._now = 0.0
        select = self._selector.select

        def virtual_select(timeout: float | None = None):
            events = select(0)
            if events or timeout == 0:
                return events
            if timeout is None:  # no timer at all: only real I/O can wake the loop
                return select(None)
            self._now += timeout
            return events

        self._selector.select = virtual_select

    def time(self) -> float:
        return self._now


def run_virtual(main: Awaitable[T]) -> T:
    """Runs main to completion on a fresh VirtualTimeLoop and closes the loop."""
    loop = VirtualTimeLoop()
    monotonic, time.monotonic = time.monotonic, loop.time
    try:
        return loop.run_until_complete(main)
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
        time.monotonic = monotonic
