"""A cancelled request ends without waiting on a replica that is slow to answer its abort (a long engine step):
the driver waits at most ABORT_WAIT_S, the abort still reaches the replica afterwards, and RouterActor.stop's
settle() waits for it (router/aborts.py)."""

from __future__ import annotations

import asyncio
import time

from tandem.router.mocks.replicas import MockDecode, MockPrefill
from tests.router.test_lifecycle import driver, request

SLOW_ABORT_S = 1.5


class SlowToAbort(MockDecode):
    """A decode replica that answers an abort only after SLOW_ABORT_S (its engine in a long step)."""

    async def abort(self, request_id: str) -> None:
        await asyncio.sleep(SLOW_ABORT_S)
        await super().abort(request_id)


def test_a_cancelled_request_ends_before_its_slow_replica_has_answered_the_abort():
    decode = SlowToAbort("decode-0", step_s=0.05)
    d = driver([MockPrefill("prefill-0")], [decode])
    d.aborts.wait_s = 0.2

    async def scenario() -> tuple[float, list[str], list[str], int]:
        async def consume():
            async for _ in d.run(request(max_tokens=200)):
                pass

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.3)  # decoding by now
        task.cancel()
        cancelled = time.monotonic()
        try:
            await task
        except asyncio.CancelledError:
            pass
        ended_after = time.monotonic() - cancelled
        aborted_at_end = list(decode.aborted)
        left = await d.aborts.settle(5.0)
        return ended_after, aborted_at_end, list(decode.aborted), left

    ended_after, aborted_at_end, aborted, left = asyncio.run(scenario())
    assert ended_after < SLOW_ABORT_S / 2, ended_after  # it did not wait for the replica's answer
    assert aborted_at_end == [] and aborted == ["r1"] and left == 0  # which came, and settle() waited for it
