"""How many replicas one pool should have: the autoscaling policy, plain Python with no Ray and no clock of its own
(the loop in cluster/pool_scaler.py feeds it one PoolSample per tick and carries out its decisions).

Every tick the pool is summarised by two numbers (cluster/pool_signals.py computes them from the router's view):
  - pressure: how close the pool is to its SLO and margins, as a ratio (1.0 = at the target; e.g. the prefill
    pool's TTFT p90 over the TTFT SLO, the decode pool's KV use over its high mark). It decides WHETHER to scale.
  - needed: how many replicas the work in the pool needs to run at the target utilization (from queued prefill
    tokens and the measured prefill rate, or from sequences in flight and the measured decode capacity). It decides
    HOW MANY, so that a burst is met in one decision instead of one replica at a time.

Scale-up: the pressure stays above 1 for a whole up window, or at panic_pressure or more for the shorter panic
window (a burst far over capacity is met at once; a moderate rise waits out the up window). The window only counts samples taken after the
pool's capacity last changed (a decision, or a starting replica becoming ready), so replicas that are still
starting are capacity that is coming: while any is starting the pool scales up again only if what it needs is at
least twice what it has and is getting (a load that kept growing), never because the start is slow. The new
count is what the work needs (current + 1 when nothing measured the need), at most max; when the work needs no
more than the pool has, a latency still over target is a backlog draining, and the pool holds.

Scale-down: for a whole down window (longer than the up window) the pressure stays under 1, no replica is
starting or draining, and even the window's busiest tick needed so few replicas that the pool ran under
down_utilization; the new count is the larger of min and what that busiest tick needed (so the replicas left
stay within the margins). The gap between target_utilization (where scale-up sizes the pool) and
down_utilization is the hysteresis that keeps a pool sized at its target from shrinking by one and growing back.
Several replicas may leave in one decision. (A latency that does not fall with fewer replicas, such as a step
time floor, never blocks a scale-down: the count comes from needed, the pressure only guards it.)

Pinned (`tandem scale POOL N`): the count is N until unpinned; bounds still apply to the autoscaler only.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Mapping


@dataclass(frozen=True)
class ScalingSettings:
    """interval_s: seconds between ticks. up_window_s / down_window_s: how long a signal must hold before the
    pool grows / shrinks. target_utilization: the share of a replica's capacity (and of the SLO) the pool is
    sized for: pressure 1 means the SLO's latency times target_utilization. down_utilization: the pool shrinks
    only when its busiest tick of the down window would have used less than this share of it. panic_window_s /
    panic_pressure: a pressure at panic_pressure or more for panic_window_s scales up without waiting out the
    up window (a burst far over capacity)."""

    interval_s: float = 1.0
    up_window_s: float = 10.0
    down_window_s: float = 60.0
    target_utilization: float = 0.8
    down_utilization: float = 0.5
    panic_window_s: float = 3.0
    panic_pressure: float = 2.0

    def __post_init__(self) -> None:
        if not self.interval_s > 0:
            raise ValueError(f"interval_s must be positive, got {self.interval_s!r}")
        if not self.interval_s <= self.panic_window_s <= self.up_window_s < self.down_window_s:
            raise ValueError(f"need interval_s <= panic_window_s <= up_window_s < down_window_s, got "
                             f"{self.interval_s:g}, {self.panic_window_s:g}, {self.up_window_s:g}, "
                             f"{self.down_window_s:g}")
        if not self.panic_pressure > 1:
            raise ValueError(f"panic_pressure must be above 1, got {self.panic_pressure:g}")
        if not 0 < self.down_utilization < self.target_utilization <= 1:
            raise ValueError(f"need 0 < down_utilization < target_utilization <= 1, got {self.down_utilization:g}, "
                             f"{self.target_utilization:g}")


@dataclass(frozen=True)
class PoolSample:
    """One pool at one tick. t: seconds on the loop's clock. ready: replicas serving; starting: placed or loading;
    draining: leaving. pressure / needed: see the module docstring (None: no traffic or nothing measured yet,
    which reads as an idle pool). inputs: the measurements behind them, for the decision log."""

    t: float
    ready: int
    starting: int = 0
    draining: int = 0
    pressure: float | None = None
    needed: float | None = None
    inputs: Mapping[str, float] = field(default_factory=dict)

    @property
    def capacity(self) -> int:
        """Replicas serving or coming."""
        return self.ready + self.starting


@dataclass(frozen=True)
class Decision:
    """What the policy wants for a pool: desired replicas (serving or coming), why, and what it saw. action:
    "up", "down" or "hold" (desired is then the current capacity)."""

    pool: str
    t: float
    action: str
    current: int
    desired: int
    reason: str
    inputs: Mapping[str, float] = field(default_factory=dict)

    def describe(self) -> str:
        seen = ", ".join(f"{k}={v:.3g}" for k, v in self.inputs.items())
        return f"{self.pool}: {self.action} {self.current} -> {self.desired}: {self.reason}" + (
            f" [{seen}]" if seen else "")


class PoolPolicy:
    def __init__(self, pool: str, minimum: int, maximum: int, settings: ScalingSettings = ScalingSettings()):
        if not 0 <= minimum <= maximum:
            raise ValueError(f"pool {pool}: need 0 <= min <= max, got {minimum}, {maximum}")
        self.pool, self.minimum, self.maximum, self.settings = pool, minimum, maximum, settings
        self.pinned: int | None = None
        self.changed_at = -math.inf  # when the capacity last changed (a decision, or a start finished)
        self._samples: deque[PoolSample] = deque()
        self._last: PoolSample | None = None

    def pin(self, count: int | None) -> None:
        """Holds the pool at count replicas (None: back to automatic). A pin may lie outside min/max."""
        if count is not None and count < 0:
            raise ValueError(f"pool {self.pool}: a replica count cannot be negative, got {count}")
        self.pinned = count
        self.changed_at = -math.inf if count is None else self.changed_at

    def decide(self, sample: PoolSample) -> Decision:
        """Takes one tick's sample and returns the decision for it (a "hold" most of the time)."""
        s = self.settings
        if self._last is not None and sample.ready > self._last.ready:  # a start finished: new capacity
            self.changed_at = sample.t
        self._last = sample
        self._samples.append(sample)
        while self._samples and self._samples[0].t < sample.t - s.down_window_s - s.interval_s:
            self._samples.popleft()
        current = sample.capacity
        if self.pinned is not None:
            if self.pinned != current:
                return self._change(sample, self.pinned, "pinned by `tandem scale`")
            return self._hold(sample, "pinned by `tandem scale`")
        if current < self.minimum:
            return self._change(sample, self.minimum, f"below min ({self.minimum})")
        if current > self.maximum:
            return self._change(sample, self.maximum, f"above max ({self.maximum})")
        panic = self._window(sample.t, s.panic_window_s)
        if panic and all(_pressure(x) >= s.panic_pressure for x in panic):
            return self._up(sample, panic, s.panic_window_s)
        up = self._window(sample.t, s.up_window_s)
        if up and all(_pressure(x) > 1.0 for x in up):
            return self._up(sample, up, s.up_window_s)
        down = self._window(sample.t, s.down_window_s)
        if down and sample.starting == 0 and sample.draining == 0 and all(_pressure(x) < 1.0 for x in down):
            return self._down(sample, down)
        return self._hold(sample, "within margins")

    def _window(self, now: float, length: float) -> list[PoolSample] | None:
        """The samples of the last `length` seconds, if they all come after the last capacity change and cover
        the whole window (within one tick); else None."""
        if self.changed_at > now - length:
            return None
        window = [x for x in self._samples if x.t >= now - length]
        if not window or window[0].t > now - length + self.settings.interval_s * 1.5:
            return None
        return window

    def _up(self, sample: PoolSample, window: list[PoolSample], length: float) -> Decision:
        current = sample.capacity
        needed = _needed(sample)
        want = min(self.maximum, math.ceil(needed - 1e-9) if sample.needed is not None else current + 1)
        if want <= current:
            return self._hold(sample, f"over target for {length:g} s but already at max "
                                      f"({self.maximum})" if current >= self.maximum else
                              f"over target while a backlog drains (the work needs {needed:.1f} replica(s))")
        if sample.starting and needed < 2 * current:
            return self._hold(sample, f"over target; {sample.starting} starting replica(s) are coming "
                                      f"(needs {needed:.1f}, getting {current})")
        return self._change(sample, want, f"pressure {min(_pressure(x) for x in window):.2f} or more for "
                                          f"{length:g} s; needs {needed:.1f} replica(s)")

    def _down(self, sample: PoolSample, window: list[PoolSample]) -> Decision:
        s = self.settings
        current = sample.capacity
        most = max(_needed(x) for x in window)
        want = max(self.minimum, math.ceil(most - 1e-9))
        if want >= current or most > current * s.down_utilization / s.target_utilization:
            return self._hold(sample, "within margins")
        return self._change(sample, want, f"under target for {self.settings.down_window_s:g} s, needing at most "
                                          f"{most:.1f} replica(s)")

    def _change(self, sample: PoolSample, desired: int, reason: str) -> Decision:
        self.changed_at = sample.t
        action = "up" if desired > sample.capacity else "down"
        return Decision(self.pool, sample.t, action, sample.capacity, desired, reason, dict(sample.inputs))

    def _hold(self, sample: PoolSample, reason: str) -> Decision:
        return Decision(self.pool, sample.t, "hold", sample.capacity, sample.capacity, reason, dict(sample.inputs))


def _pressure(sample: PoolSample) -> float:
    return 0.0 if sample.pressure is None else sample.pressure


def _needed(sample: PoolSample) -> float:
    """Replicas the sample's work needs; without a measured need, proportional to the pressure."""
    return sample.needed if sample.needed is not None else sample.ready * _pressure(sample)
