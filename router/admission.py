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

Under the fair policy (the decode pool's `scheduler.policy`, or the prefill pool's: the driver's rooms), requests
start in fair order, not in arrival order, so the backlog ahead of a new request is its own tenant's: its expected
time to start is

    (its tenant's waiting + 1) / (start rate x its tenant's share)

the share being its tenant's weight over the weights of the tenants with requests waiting (its own included), and
a request whose tenant has nothing waiting is always admitted (it goes before every backlog). One tenant's backlog
then gets no other tenant refused; max_queued_requests still bounds the total, and initial_waiting each tenant's.

Each admitted request holds a Ticket: started() at its first token, close() however it ends (error, cancel,
deadline); both are idempotent, so the count cannot leak. Plain Python on one event loop, clock injected.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from tandem.engine.engine_config import SchedulingConfig
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

    def __init__(self, controller: AdmissionController, tenant: str | None):
        self._controller = controller
        self.tenant = tenant
        self.open = True

    def started(self) -> None:
        """Its first token arrived: it leaves the waiting requests and counts as a start. Idempotent."""
        if self.open:
            self.open = False
            self._controller._leave(self.tenant, started=True)

    def close(self) -> None:
        """It ended (any way) before or after starting: it leaves the waiting requests if still there."""
        if self.open:
            self.open = False
            self._controller._leave(self.tenant, started=False)


class AdmissionController:
    def __init__(self, settings: AdmissionSettings, *, queue_timeout_s: float, max_queued_requests: int,
                 fair: SchedulingConfig | None = None, clock: Callable[[], float] = time.monotonic):
        """queue_timeout_s, max_queued_requests: the driver's (DriverSettings). fair: the scheduling config whose
        tenant weights requests start by (the fair policy; None: they start in arrival order). clock: monotonic
        seconds."""
        self.settings = settings
        self.limit_s = settings.ttft_slo_s if settings.mode == "slo" else queue_timeout_s
        self.max_waiting = max_queued_requests
        self.fair = fair
        self.clock = clock
        self.rates = StartRate(settings.window_s)
        self.waiting = 0
        self.waiting_by_tenant: dict[str | None, int] = {}  # those with requests waiting
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

    def check(self, count: int = 1, tenant: str | None = None) -> None:
        """Raises AtCapacity if count more requests of tenant would not be admitted now; holds nothing (a front
        door's early refusal, before it parses a request)."""
        rate = self.start_rate()
        waiting = self.waiting
        if waiting == 0:
            return
        ahead = f"{waiting} request{' is' if waiting == 1 else 's are'} waiting to start"
        if waiting + count > self.max_waiting:
            retry = UNMEASURED_RETRY_AFTER_S if rate is None else _whole((waiting + count - self.max_waiting) / rate)
            self._refuse(f"{ahead} (at most {self.max_waiting} may, router.max_queued_requests)", retry,
                         "max_queued")
        backlog, share = waiting, 1.0  # the requests that start before it, and its part of the starts
        if self.fair is not None:
            if not (backlog := self.waiting_by_tenant.get(tenant, 0)):
                return  # it starts before every other tenant's backlog
            ahead = f"tenant {tenant!r} has {backlog} request{'' if backlog == 1 else 's'} waiting to start"
            weight = self.fair.weight(tenant)
            share = weight / (weight + sum(self.fair.weight(t) for t in self.waiting_by_tenant if t != tenant))
        if rate is None:
            if backlog + count > self.settings.initial_waiting:
                self._refuse(f"{ahead} and no start rate has been measured yet (at most "
                             f"{self.settings.initial_waiting} may wait until one is)", UNMEASURED_RETRY_AFTER_S,
                             "unmeasured")
            return
        expected = (backlog + count) / (rate * share)
        if expected > self.limit_s:
            limit = ("its TTFT SLO" if self.settings.mode == "slo" else "the queue timeout") + f" of {self.limit_s:g} s"
            starts = f"{rate:.1f} per second" + (f" ({share:.0%} of them its tenant's)" if share < 1 else "")
            self._refuse(f"{ahead} and it starts about {starts}, so a new one would start in about "
                         f"{expected:.1f} s, past {limit}", _whole(expected - self.limit_s), self.settings.mode)

    def admit(self, tenant: str | None = None) -> Ticket:
        """Admits one request of tenant (it waits to start from now), or raises AtCapacity holding nothing."""
        self.check(1, tenant)
        self._advance(self.clock())
        self.waiting += 1
        self.waiting_by_tenant[tenant] = self.waiting_by_tenant.get(tenant, 0) + 1
        return Ticket(self, tenant)

    def _refuse(self, why: str, retry_after_s: int, reason: str) -> None:
        self.num_refused += 1
        raise AtCapacity(f"the cluster is at capacity: {why}; retry in {retry_after_s} s", retry_after_s, reason)

    def _leave(self, tenant: str | None, *, started: bool) -> None:
        now = self.clock()
        self._advance(now)
        self.waiting -= 1
        if (left := self.waiting_by_tenant[tenant] - 1) > 0:
            self.waiting_by_tenant[tenant] = left
        else:
            del self.waiting_by_tenant[tenant]
        if started:
            self.rates.start(now)
            self._measure(now)


def _whole(seconds: float) -> int:
    """seconds rounded up to a whole number, at least 1 (a Retry-After)."""
    return max(1, math.ceil(seconds - 1e-9))
