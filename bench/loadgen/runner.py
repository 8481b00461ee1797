"""Open loop, closed loop and rate sweeps over one Backend.

Open loop: every conversation has a due time from the arrival process; the pacer sleeps until it and starts the
conversation, whether or not earlier requests have finished, so a slow server meets the load it was asked to
carry and its queueing shows in the latencies (measured from the due times). A session's later turns are due
think time after the previous answer. Closed loop: `concurrency` clients each send their next request as soon as
their previous one ends (the due time is then the moment it is picked up).
"""

from __future__ import annotations

import asyncio
import itertools
import sys
from dataclasses import replace
from typing import Callable, Sequence

from tandem.bench.loadgen.arrivals import RealClock
from tandem.bench.loadgen.records import Backend, Clock, RequestRecord
from tandem.bench.loadgen.workloads import Conversation


class Progress:
    """A progress bar (tqdm, on stderr) of finished requests, with sent / failed counts; silent when quiet."""

    def __init__(self, total: int, label: str, quiet: bool = False):
        self.bar = None
        if not quiet:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=label, unit="req", file=sys.stderr, mininterval=0.5, leave=True)
        self.sent = self.failed = 0

    def on_sent(self) -> None:
        self.sent += 1

    def on_done(self, record: RequestRecord) -> None:
        self.failed += record.error is not None
        if self.bar is not None:
            self.bar.set_postfix(sent=self.sent, failed=self.failed, refresh=False)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class _Run:
    """One run's shared state: the backend, the clock, the records in order of creation."""

    def __init__(self, backend: Backend, clock: Clock, progress: Progress | None):
        self.backend, self.clock, self.progress = backend, clock, progress
        self.records: list[RequestRecord] = []
        self._index = itertools.count()

    async def conversation(self, conversation: Conversation, due: float) -> None:
        """Sends the conversation's requests in turn, the first due at `due`; a failed turn ends the session."""
        history: tuple[tuple[str, str], ...] = ()
        for request in conversation.requests:
            await self.clock.sleep_until(due)
            if request.messages is not None:
                turn = request.messages
                request = replace(request, messages=history + turn)
            record = RequestRecord(next(self._index), due, klass=request.klass, session_id=request.session_id,
                                   turn=request.turn, max_tokens=request.max_tokens)
            self.records.append(record)
            if self.progress:
                self.progress.on_sent()
            text = await self.backend.send(request, record, self.clock)
            if self.progress:
                self.progress.on_done(record)
            if not record.ok:
                return
            if request.messages is not None:
                history = request.messages + (("assistant", text),)
            due = record.end_s + conversation.think_s


def _count(conversations: Sequence[Conversation]) -> int:
    return sum(len(c.requests) for c in conversations)


async def open_loop(conversations: Sequence[Conversation], backend: Backend, *, clock: Clock | None = None,
                    label: str = "open loop", quiet: bool = False) -> list[RequestRecord]:
    """Starts each conversation at its at_s (seconds after the run starts) and returns every request's record
    once all have ended, in the order they were due. Raises ValueError for a conversation without at_s."""
    if any(c.at_s is None for c in conversations):
        raise ValueError("an open-loop run needs a due time for every conversation")
    clock = clock or RealClock()
    progress = Progress(_count(conversations), label, quiet)
    run = _Run(backend, clock, progress)
    tasks = []
    try:
        for conversation in sorted(conversations, key=lambda c: c.at_s):
            await clock.sleep_until(conversation.at_s)
            tasks.append(asyncio.ensure_future(run.conversation(conversation, conversation.at_s)))
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        progress.close()
    return sorted(run.records, key=lambda r: (r.scheduled_s, r.index))


async def closed_loop(conversations: Sequence[Conversation], backend: Backend, concurrency: int, *,
                      clock: Clock | None = None, duration_s: float | None = None, label: str = "closed loop",
                      quiet: bool = False) -> list[RequestRecord]:
    """concurrency clients take conversations in order until none are left (or duration_s has passed)."""
    if concurrency < 1:
        raise ValueError(f"--concurrency must be at least 1, got {concurrency}")
    clock = clock or RealClock()
    progress = Progress(_count(conversations), label, quiet)
    run = _Run(backend, clock, progress)
    queue = list(reversed(conversations))

    async def client() -> None:
        while queue and (duration_s is None or clock.now() < duration_s):
            await run.conversation(queue.pop(), clock.now())

    try:
        await asyncio.gather(*(client() for _ in range(concurrency)))
    finally:
        progress.close()
    return sorted(run.records, key=lambda r: (r.scheduled_s, r.index))


async def warm_up(conversations: Sequence[Conversation], backend: Backend, count: int) -> list[RequestRecord]:
    """count requests one at a time before the measured run (connections opened, caches and kernels warm); their
    records are returned for errors only, never summarized."""
    if count <= 0:
        return []
    picked = [replace(c, at_s=None) for c in itertools.islice(itertools.cycle(conversations), count)]
    return await closed_loop(picked, backend, 1, label="warm-up", quiet=True)


async def sweep(rates: Sequence[float], make: Callable[[float], Sequence[Conversation]], backend: Backend, *,
                quiet: bool = False) -> list[tuple[float, list[RequestRecord]]]:
    """An open-loop run at each rate in turn (make(rate) gives its conversations), each starting when the
    previous one has fully ended."""
    return [(rate, await open_loop(make(rate), backend, label=f"{rate:g} req/s", quiet=quiet)) for rate in rates]
