"""Admission under overload: whether a new request can start (produce its first token) in time, decided before any
work is done for it. A request that cannot is refused at once (AtCapacity: gRPC RESOURCE_EXHAUSTED with a
`retry-after` trailer, HTTP 429 with Retry-After) instead of waiting in the router's or a replica's queue.

The controller counts the requests it admitted that have not started yet (`waiting`: queued at the router,
queued in a replica's engine, or prefilling) and measures the cluster's start rate: first tokens per second of
time during which at least one request was waiting, over a sliding window (StartRate). Time with nothing waiting
is left out, so a lightly loaded cluster is not taken for a slow one. A new request's expected time to start is

    (waiting + 1) / start rate        # the requests ahead of it, and itself

and it is refused when that exceeds the limit: the driver's queue_timeout_s ("queue_timeout" mode) or the TTFT
SLO ("slo" mode). Its Retry-After is the time the backlog needs to drain below the limit at the measured rate,
rounded up to whole seconds (at least 1). Before any rate has been measured, up to initial_waiting requests may
wait. max_queued_requests bounds `waiting` in every mode. A request that finds nothing waiting is always
admitted: there is no backlog to refuse it for, and it is how a rate that was measured too low gets measured
again.

Each admitted request holds a Ticket: started() at its first token, close() however it ends (error, cancel,
deadline); both are idempotent, so the count cannot leak. Plain Python on one event loop, clock injected.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from tandem.router.replicas import NoCapacityError
from tandem.router.limits import AdmissionSettings

BUCKET_S = 1.0  # the start rate's time resolution
MIN_STARTS = 4  # starts (while requests waited) the window must hold for its rate to count as measured
UNMEASURED_RETRY_AFTER_S = 1  # what a client refused before any rate was measured is told to wait


class AtCapacity(NoCapacityError):
    """The cluster cannot start the request in time (RESOURCE_EXHAUSTED / 429). retry_after_s: whole seconds
    the client should wait; reason: "max_queued", "unmeasured", "queue_timeout" or "slo" (the metric's label)."""

    def __init__(self, message: str, retry_after_s: int, reason: str):
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.reason = reason


class StartRate:
    """First tokens per second of busy time (time with at least one request waiting to start), over the last
    window_s seconds. Buckets of BUCKET_S hold (starts, busy seconds); the caller reports busy intervals and
    starts in time order."""

    def __init__(self, window_s: float):
        self.window_s = window_s
        self._buckets: deque[list[float]] = deque()  # [bucket index, starts, busy seconds], oldest first

    def _bucket(self, t: float) -> list[float]:
        index = math.floor(t / BUCKET_S)
        if not self._buckets or self._buckets[-1][0] < index:
            self._buckets.append([index, 0, 0.0])
        return self._buckets[-1]

    def busy(self, start: float, end: float) -> None:
        """Requests waited from start to end (seconds, start <= end)."""
        t = start
        while t < end:
            stop = min(end, (math.floor(t / BUCKET_S) + 1) * BUCKET_S)
            self._bucket(t)[2] += stop - t
            t = stop

    def start(self, now: float) -> None:
        """A waiting request produced its first token."""
        self._bucket(now)[1] += 1

    def measure(self, now: float) -> float | None:
        """Starts per busy second over the window ending at now; None while it holds fewer than MIN_STARTS."""
        oldest = math.floor((now - self.window_s) / BUCKET_S)
        while self._buckets and self._buckets[0][0] < oldest:
            self._buckets.popleft()
        starts = sum(b[1] for b in self._buckets)
        busy = sum(b[2] for b in self._buckets)
        if starts < MIN_STARTS or busy <= 0:
            return None
        return starts / busy


@dataclass(frozen=True)
class AdmissionState:
    """What the controller knows now: requests waiting to start, the start rate it goes by (per second; None:
    none measured yet) and the limit on a new request's expected wait (seconds)."""

    waiting: int
    start_rate: float | None
    limit_s: float


class Ticket:
    """One admitted request's place among those waiting to start."""

    def __init__(self, controller: AdmissionController):
        self._controller = controller
        self.open = True

    def started(self) -> None:
        """Its first token arrived: it leaves the waiting requests and counts as a start. Idempotent."""
        if self.open:
            self.open = False
            self._controller._leave(started=True)

    def close(self) -> None:
        """It ended (any way) before or after starting: it leaves the waiting requests if still there."""
        if self.open:
            self.open = False
            self._controller._leave(started=False)


class AdmissionController:
    def __init__(self, settings: AdmissionSettings, *, queue_timeout_s: float, max_queued_requests: int,
                 clock: Callable[[], float] = time.monotonic):
        """queue_timeout_s, max_queued_requests: the driver's (DriverSettings). clock: monotonic seconds."""
        self.settings = settings
        self.limit_s = settings.ttft_slo_s if settings.mode == "slo" else queue_timeout_s
        self.max_waiting = max_queued_requests
        self.clock = clock
        self.rates = StartRate(settings.window_s)
        self.waiting = 0
        self.num_refused = 0
        self._since = clock()  # when `waiting` last changed
        self._rate: float | None = None  # the last measured rate: kept while the window holds too few starts

    def _advance(self, now: float) -> None:
        if self.waiting > 0:
            self.rates.busy(self._since, now)
        self._since = now

    def start_rate(self) -> float | None:
        """Starts per second of busy time: the window's measurement, else the last one (None: never measured)."""
        now = self.clock()
        self._advance(now)
        return self._measure(now)

    def _measure(self, now: float) -> float | None:
        rate = self.rates.measure(now)
        if rate is not None:
            self._rate = rate
        return self._rate

    def state(self) -> AdmissionState:
        return AdmissionState(self.waiting, self.start_rate(), self.limit_s)

    def check(self, count: int = 1) -> None:
        """Raises AtCapacity if count more requests would not be admitted now; holds nothing (a front door's
        early refusal, before it parses a request)."""
        rate = self.start_rate()
        waiting = self.waiting
        if waiting == 0:
            return
        ahead = f"{waiting} request{' is' if waiting == 1 else 's are'} waiting to start"
        if waiting + count > self.max_waiting:
            retry = UNMEASURED_RETRY_AFTER_S if rate is None else _whole((waiting + count - self.max_waiting) / rate)
            self._refuse(f"{ahead} (at most {self.max_waiting} may, router.max_queued_requests)", retry,
                         "max_queued")
        if rate is None:
            if waiting + count > self.settings.initial_waiting:
                self._refuse(f"{ahead} and no start rate has been measured yet (at most "
                             f"{self.settings.initial_waiting} may wait until one is)", UNMEASURED_RETRY_AFTER_S,
                             "unmeasured")
            return
        expected = (waiting + count) / rate
        if expected > self.limit_s:
            limit = ("its TTFT SLO" if self.settings.mode == "slo" else "the queue timeout") + f" of {self.limit_s:g} s"
            self._refuse(f"{ahead} and it starts about {rate:.1f} per second, so a new one would start in about "
                         f"{expected:.1f} s, past {limit}", _whole(expected - self.limit_s), self.settings.mode)

    def admit(self) -> Ticket:
        """Admits one request (it waits to start from now), or raises AtCapacity holding nothing."""
        self.check(1)
        self._advance(self.clock())
        self.waiting += 1
        return Ticket(self)

    def _refuse(self, why: str, retry_after_s: int, reason: str) -> None:
        self.num_refused += 1
        raise AtCapacity(f"the cluster is at capacity: {why}; retry in {retry_after_s} s", retry_after_s, reason)

    def _leave(self, *, started: bool) -> None:
        now = self.clock()
        self._advance(now)
        self.waiting -= 1
        if started:
            self.rates.start(now)
            self._measure(now)


def _whole(seconds: float) -> int:
    """seconds rounded up to a whole number, at least 1 (a Retry-After)."""
    return max(1, math.ceil(seconds - 1e-9))
