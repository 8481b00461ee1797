"""When each request is due, and the pacer that sends it then.

Arrival processes give every request a scheduled send time (seconds after the run starts), all computed before
the run: constant (one every 1/rate s), Poisson (exponential gaps) and gamma (gaps with shape `burstiness`:
below 1 burstier than Poisson, above 1 smoother, 1 is Poisson; the mean rate stays `rate`, as in vLLM's
`--burstiness`). The pacer sleeps until each absolute due time, never for a fixed interval, so the time spent
sending does not accumulate into drift (vLLM #21104: a sender that slept 1/rate after each send delivered 183.5
req/s for 200 asked). Whatever lateness remains is measured (RequestRecord.sent_s - scheduled_s) and latencies
count from the due time.
"""

from __future__ import annotations

import asyncio
import heapq
import random
import time
from dataclasses import dataclass

ARRIVALS = ("constant", "poisson", "gamma")


@dataclass(frozen=True)
class ArrivalProcess:
    """rate: requests per second (> 0); kind: one of ARRIVALS; burstiness: the gamma distribution's shape
    (gamma only)."""

    rate: float
    kind: str = "poisson"
    burstiness: float = 1.0

    def __post_init__(self):
        if self.kind not in ARRIVALS:
            raise ValueError(f"unknown arrival process {self.kind!r}; choose one of {', '.join(ARRIVALS)}")
        if not self.rate > 0:
            raise ValueError(f"the request rate must be positive, got {self.rate}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness must be positive, got {self.burstiness}")

    def offsets(self, *, count: int | None = None, duration_s: float | None = None, seed: int = 0) -> list[float]:
        """Due times in seconds from the start, ascending, the first at 0: `count` of them, or as many as fall
        before duration_s, whichever bound comes first. Raises ValueError when neither bound is given."""
        if count is None and duration_s is None:
            raise ValueError("give a number of requests or a duration (or both)")
        rng = random.Random(seed)
        out: list[float] = []
        t = 0.0
        while (count is None or len(out) < count) and (duration_s is None or t < duration_s):
            out.append(t)
            t += self._gap(rng)
        return out

    def _gap(self, rng: random.Random) -> float:
        if self.kind == "constant":
            return 1.0 / self.rate
        if self.kind == "poisson":
            return rng.expovariate(self.rate)
        return rng.gammavariate(self.burstiness, 1.0 / (self.rate * self.burstiness))


class RealClock:
    """Seconds since construction, on time.perf_counter."""

    def __init__(self):
        self.start = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.start

    async def sleep_until(self, t: float) -> None:
        # asyncio may wake a timer up to its clock resolution early: sleep again until t has really passed.
        while (delay := t - self.now()) > 0:
            await asyncio.sleep(delay)


class FakeClock:
    """Virtual time for tests of pacing: nothing really sleeps. drive(main) runs main; whenever every task has
    gone quiet (after a round of yields), the earliest sleeper wakes and the clock jumps to its time (plus lag_s,
    a wake-up lateness that tests use to check that lateness is measured, not hidden). Only for code that waits on
    nothing but this clock."""

    def __init__(self, lag_s: float = 0.0):
        self.t = 0.0
        self.lag_s = lag_s
        self._sleepers: list[tuple[float, int, asyncio.Future]] = []
        self._seq = 0

    def now(self) -> float:
        return self.t

    async def sleep_until(self, t: float) -> None:
        if t <= self.t:
            await asyncio.sleep(0)
            return
        future = asyncio.get_running_loop().create_future()
        self._seq += 1
        heapq.heappush(self._sleepers, (t, self._seq, future))
        await future

    async def drive(self, main):
        """Runs the coroutine main in virtual time and returns its result. Raises RuntimeError when main waits
        on something other than this clock (nothing sleeps, yet it does not finish)."""
        task = asyncio.ensure_future(main)
        idle_rounds = 0
        while not task.done():
            for _ in range(20):
                await asyncio.sleep(0)
            if task.done():
                break
            if not self._sleepers:
                idle_rounds += 1
                if idle_rounds > 50:
                    task.cancel()
                    raise RuntimeError("FakeClock: the coroutine waits on something other than the clock")
                continue
            idle_rounds = 0
            t, _, future = heapq.heappop(self._sleepers)
            self.t = max(self.t, t + self.lag_s)
            future.set_result(None)
        return task.result()
