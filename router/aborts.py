"""Telling replicas to drop a request (its blocks freed there) without making the client wait for them: a replica
answers an abort between two engine steps, and on a loaded CPU one prefill step of a long prompt has taken tens of
seconds. A request's end waits at most ABORT_WAIT_S for its replicas' answers; past that the aborts go on in the
background, held here until they are done (RouterActor.stop waits for them)."""

from __future__ import annotations

import asyncio
import logging
from typing import Sequence

from tandem.router.replicas import Replica

_log = logging.getLogger(__name__)
ABORT_WAIT_S = 2.0


async def abort_everywhere(request_id: str, touched: Sequence[tuple[Replica, str]]) -> None:
    """Tells every replica the request touched to drop it, by the id it runs there (no-op where it finished)."""
    results = await asyncio.gather(*(replica.api.abort(rid) for replica, rid in touched), return_exceptions=True)
    for (replica, _), result in zip(touched, results):
        if isinstance(result, BaseException):  # a dead replica holds nothing any more
            _log.warning("abort of %s on %s failed: %r", request_id, replica.name, result)


class Aborts:
    def __init__(self, wait_s: float = ABORT_WAIT_S):
        self.wait_s = wait_s
        self.pending: set[asyncio.Task] = set()

    async def abort(self, request_id: str, touched: Sequence[tuple[Replica, str]]) -> None:
        """abort_everywhere, waited for at most wait_s (also when the caller is cancelled meanwhile: the aborts
        go on regardless)."""
        task = asyncio.ensure_future(abort_everywhere(request_id, list(touched)))
        self.pending.add(task)
        task.add_done_callback(self.pending.discard)
        await asyncio.wait([task], timeout=self.wait_s)

    async def settle(self, timeout_s: float) -> int:
        """Waits up to timeout_s for the aborts still going on; returns how many were left."""
        if self.pending:
            await asyncio.wait(list(self.pending), timeout=timeout_s)
        return len(self.pending)
