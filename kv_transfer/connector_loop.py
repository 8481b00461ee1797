"""A connector driven from a serving loop: polled on the AsyncEngine's thread (its tick hook), with each
request's outcome (DONE, or FAILED / EXPIRED / ABORTED and why) handed to the coroutine that waits for it.

Thread contract: tick(), and the functions wait() and forget() send through AsyncEngine.call(), run on the engine
thread, which alone touches the connector; results reach coroutines through their event loop.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Callable

from tandem.engine.core.async_engine import AsyncEngine
from tandem.kv_transfer.connector import DecodeConnector, PrefillConnector, TransferEvent
from tandem.kv_transfer.descriptor import TransferState

OUTCOME_TTL_S = 300.0  # an outcome nobody came for (its router went away) is forgotten after this long



@dataclass
class _Waiter:
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future


class ConnectorLoop:
    def __init__(self, connector: DecodeConnector | PrefillConnector, *,
                 on_failed: Callable[[TransferEvent], None] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        """on_failed: called on the engine thread for every transfer that ends badly (e.g. to end a stream)."""
        self.connector = connector
        self.on_failed = on_failed
        self.clock = clock
        self._outcomes: dict[str, tuple[TransferEvent, float]] = {}
        self._waiters: dict[str, _Waiter] = {}

    def tick(self) -> bool:
        """Engine thread: polls the connector, settles waiters. True while transfers are pending."""
        for event in self.connector.poll():
            if not event.state.terminal:
                continue
            if event.state is not TransferState.DONE and self.on_failed is not None:
                self.on_failed(event)
            waiter = self._waiters.pop(event.request_id, None)
            if waiter is not None:
                waiter.loop.call_soon_threadsafe(_settle, waiter.future, event)
            else:
                self._outcomes[event.request_id] = (event, self.clock())
        if self._outcomes:
            cutoff = self.clock() - OUTCOME_TTL_S
            for request_id in [r for r, (_, t) in self._outcomes.items() if t < cutoff]:
                del self._outcomes[request_id]
        return self.connector.num_pending > 0

    async def wait(self, server: AsyncEngine, request_id: str) -> TransferEvent:
        """The request's terminal transfer event (it may have happened already). Raises KeyError for a request
        the connector never held or whose outcome was already taken."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def register(_engine) -> None:
            if request_id in self._outcomes:
                future_event = self._outcomes.pop(request_id)[0]
                loop.call_soon_threadsafe(_settle, future, future_event)
            elif self.connector.state(request_id) is not None:
                self._waiters[request_id] = _Waiter(loop, future)
            else:
                raise KeyError(f"no KV transfer is known for request {request_id!r}")

        await server.call(register)
        try:
            return await future
        finally:
            if not future.done():
                await server.call(lambda _e: self._waiters.pop(request_id, None))

    def forget(self, request_id: str) -> None:
        """Engine thread: aborts the request's transfer if it still runs and drops any outcome or waiter."""
        self.connector.abort(request_id)
        self._outcomes.pop(request_id, None)
        waiter = self._waiters.pop(request_id, None)
        if waiter is not None:
            event = TransferEvent(request_id, TransferState.ABORTED, "aborted")
            waiter.loop.call_soon_threadsafe(_settle, waiter.future, event)


def _settle(future: asyncio.Future, event: TransferEvent) -> None:
    if not future.done():
        future.set_result(event)
