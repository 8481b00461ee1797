"""One autoscaling loop per pool: every interval it reads the pool's load, asks the policy
(cluster/autoscaling.py) what the pool should have and has its Actuator start or drain replicas. Loops of
different pools share nothing but the clock, so the prefill and decode pools scale independently.

The Actuator is the pool's replicas as the loop sees them: the control plane's Ray actors
(cluster/controller.py), or in-process mock replicas for tests and bench/autoscale.py (cluster/mock_cluster.py).
Starting is asynchronous: start() returns at once and the replica counts as starting until it serves. drain()
picks replicas to leave, stops routing to them and lets them finish what they hold before they stop.

Every decision that changes something is logged with its inputs and kept (the last MAX_HISTORY) for
`tandem status`, the metrics and the benchmarks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections import deque
from dataclasses import dataclass
from typing import Awaitable, Callable, Protocol

from tandem.cluster.autoscaling import Decision, PoolPolicy, PoolSample
from tandem.cluster.pool_pressure import PoolGauge
from tandem.router.pool_signals import PoolLoad

_log = logging.getLogger(__name__)
MAX_HISTORY = 256


@dataclass(frozen=True)
class PoolCounts:
    ready: int
    starting: int
    draining: int


class Actuator(Protocol):
    def counts(self, pool: str) -> PoolCounts:
        """The pool's replicas now: serving, starting (placed or loading) and draining."""

    async def load(self, pool: str) -> PoolLoad:
        """What the router measured of the pool over its window."""

    def start(self, pool: str, count: int) -> None:
        """Begins starting count more replicas (returns at once)."""

    def drain(self, pool: str, count: int) -> None:
        """Begins removing count replicas: starting ones first, then serving ones; each takes no new requests,
        finishes what it has and stops (returns at once)."""

    def can_grow(self, pool: str) -> bool:
        """False while the cluster lacks the resources for another replica of the pool (a shortfall)."""


class PoolScaler:
    def __init__(self, pool: str, policy: PoolPolicy, gauge: PoolGauge, actuator: Actuator,
                 clock: Callable[[], float], *, on_decision: Callable[[Decision], None] | None = None):
        self.pool, self.policy, self.gauge, self.actuator, self.clock = pool, policy, gauge, actuator, clock
        self.on_decision = on_decision
        self.last: Decision | None = None  # the last decision that changed something
        self.last_sample: PoolSample | None = None
        self.history: deque[Decision] = deque(maxlen=MAX_HISTORY)
        self.ticks = 0
        self.changes = 0  # decisions that changed something, ever

    async def tick(self) -> Decision:
        """One round: measure, decide, act. Returns the decision (a "hold" most ticks)."""
        counts = self.actuator.counts(self.pool)
        load = await self.actuator.load(self.pool)
        sample = self.gauge.sample(load, self.clock(), ready=counts.ready, starting=counts.starting,
                                   draining=counts.draining)
        self.last_sample = sample
        decision = self.policy.decide(sample)
        self.ticks += 1
        if decision.action == "up" and not self.actuator.can_grow(self.pool):
            decision = dataclasses.replace(decision, action="hold", desired=decision.current,
                                           reason=f"wants {decision.desired} but the cluster lacks the resources "
                                                  "(see the pool's shortfall)")
        if decision.action != "hold":
            self._act(decision)
        return decision

    def _act(self, decision: Decision) -> None:
        _log.info("autoscale %s", decision.describe())
        self.last = decision
        self.changes += 1
        self.history.append(decision)
        if decision.desired > decision.current:
            self.actuator.start(self.pool, decision.desired - decision.current)
        else:
            self.actuator.drain(self.pool, decision.current - decision.desired)
        if self.on_decision is not None:
            self.on_decision(decision)

    async def run(self, sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        """Ticks every interval until cancelled; a failed tick is logged and the loop goes on."""
        while True:
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception:
                _log.exception("autoscaling tick of pool %s failed", self.pool)
            await sleep(self.policy.settings.interval_s)
