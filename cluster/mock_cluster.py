"""An autoscaled cluster in one process, for the autoscaling tests and bench/autoscale.py: the router's real request
driver and KV feed over batching mock replicas (router/mocks/batching.py), one PoolScaler per pool
(cluster/pool_scaler.py) whose Actuator is this class. A started replica serves start_delay_s after the decision
(a model load); a drained one leaves routing at once and stops when its last request has finished. Everything
runs on the event loop's clock, so under a virtual-time loop (cluster/virtual_time.py) minutes of load take
seconds and the result does not depend on the machine.

    cluster = MockCluster("disaggregated", costs, initial={"prefill": 1, "decode": 1}, bounds=..., slo=...)
    async with cluster.running():
        ... send requests with cluster.driver (or cluster/simulation.py's DriverBackend) ...
"""

from __future__ import annotations

import asyncio
import itertools
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from tandem.cluster.autoscaling import Decision, PoolPolicy, ScalingSettings
from tandem.cluster.pool_pressure import SLO, PoolGauge
from tandem.cluster.pool_scaler import PoolCounts, PoolScaler
from tandem.engine.sampling_params import SamplingParams
from tandem.router.accounting import Accounting, Timings
from tandem.router.driver_settings import DriverSettings
from tandem.router.lifecycle import RequestDriver
from tandem.router.mocks.batching import BLOCK_SIZE, BatchedDecode, BatchedPrefill, StepCosts
from tandem.router.pool_signals import PoolLoad, PoolSignals
from tandem.router.replicas import Replica
from tandem.router.request_parsing import ParsedRequest


@dataclass(frozen=True)
class ReplicaEvent:
    """A change in a pool's replicas, for the replica-count plots: t on the loop's clock; what: "decided",
    "ready", "draining" or "stopped"; in_flight: requests on the replica then (draining: what it must finish)."""

    t: float
    pool: str
    what: str
    name: str
    in_flight: int = 0


class MockCluster:
    def __init__(self, mode: str, costs: StepCosts, *, initial: dict[str, int], bounds: dict[str, tuple[int, int]],
                 slo: SLO, settings: ScalingSettings = ScalingSettings(), start_delay_s: float = 5.0,
                 driver_settings: DriverSettings | None = None, window_s: float = 10.0, autoscale: bool = True):
        """initial / bounds: replicas per pool at the start and (min, max); the pools are prefill and decode in
        disaggregated mode, decode alone in colocated mode."""
        self.mode, self.costs, self.start_delay_s = mode, costs, start_delay_s
        self.pools = ("prefill", "decode") if mode == "disaggregated" else ("decode",)
        settings_ = driver_settings or DriverSettings()
        self.driver = RequestDriver([], [], DriverSettings(**{**vars(settings_), "mode": mode}),
                                    block_size=BLOCK_SIZE)
        self.loop = asyncio.get_running_loop()
        self.signals = PoolSignals(window_s=window_s, clock=self.loop.time)
        self.events: list[ReplicaEvent] = []
        self.stopped: list[BatchedPrefill | BatchedDecode] = []
        self._starting: dict[str, list[asyncio.Task]] = {pool: [] for pool in self.pools}
        self._draining: dict[str, set[str]] = {pool: set() for pool in self.pools}
        self._tasks: set[asyncio.Task] = set()
        self._names = itertools.count()
        self._initial = initial
        self.scalers = {pool: PoolScaler(
            pool, PoolPolicy(pool, *bounds[pool], settings),
            PoolGauge(pool, slo, colocated=mode == "colocated", target_utilization=settings.target_utilization,
                      max_num_seqs=costs.max_num_seqs, startup_s=start_delay_s),
            self, self.loop.time, on_decision=self._decided) for pool in self.pools}
        self.autoscale = autoscale

    # -- Actuator ----------------------------------------------------------------------------------------

    def counts(self, pool: str) -> PoolCounts:
        serving = self.driver.prefill if pool == "prefill" else self.driver.decode
        return PoolCounts(len(serving), len(self._starting[pool]), len(self._draining[pool]))

    async def load(self, pool: str) -> PoolLoad:
        replicas = self.driver.prefill if pool == "prefill" else self.driver.decode
        d = self.driver
        if pool == "prefill":
            return self.signals.load(pool, replicas, waiting_tokens=d.prefill_waiting_tokens)
        return self.signals.load(pool, replicas, queued=d.num_queued, waiting=d.num_waiting_prefill)

    def start(self, pool: str, count: int) -> None:
        for _ in range(count):
            self._starting[pool].append(self._spawn(self._start(pool, self.start_delay_s)))

    def drain(self, pool: str, count: int) -> None:
        starting = self._starting[pool]
        while count and starting:
            starting.pop().cancel()
            count -= 1
        serving = sorted(self.driver.prefill if pool == "prefill" else self.driver.decode,
                         key=lambda r: r.load.in_flight)
        for replica in serving[:count]:
            self._spawn(self._drain(replica))

    def can_grow(self, pool: str) -> bool:
        return True

    # -- replicas ----------------------------------------------------------------------------------------

    async def _start(self, pool: str, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        name = f"{pool}-{next(self._names)}"
        api = BatchedPrefill(name, self.costs) if pool == "prefill" else BatchedDecode(name, self.costs)
        self.driver.add(Replica(name, pool, api, await api.ready()))
        self._starting[pool].remove(asyncio.current_task())
        self.events.append(ReplicaEvent(self.loop.time(), pool, "ready", name))

    async def _drain(self, replica: Replica) -> None:
        self._draining[replica.pool].add(replica.name)
        self.driver.remove(replica.name)  # requests already there keep their handle and finish
        self.events.append(ReplicaEvent(self.loop.time(), replica.pool, "draining", replica.name,
                                        replica.load.in_flight))
        while replica.load.in_flight > 0:
            await asyncio.sleep(0.05)
        await replica.api.shutdown()
        self.stopped.append(replica.api)
        self._draining[replica.pool].discard(replica.name)
        self.events.append(ReplicaEvent(self.loop.time(), replica.pool, "stopped", replica.name))

    def _spawn(self, coroutine) -> asyncio.Task:
        task = self.loop.create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _decided(self, decision: Decision) -> None:
        self.events.append(ReplicaEvent(decision.t, decision.pool, "decided", f"{decision.current}->"
                                                                             f"{decision.desired}"))

    async def generate(self, request_id: str, prompt: tuple[int, ...], max_tokens: int, *,
                       on_tokens: Callable[[int], None] | None = None) -> Timings:
        """Runs one greedy request through the router's driver as the front doors do (the pool signals see its
        progress); returns its timings on the loop's clock. on_tokens(count): called as output tokens arrive.
        Raises what the driver raises."""
        arrival = self.loop.time()
        self.signals.arrived(len(prompt), max_tokens, arrival)
        account = Accounting(arrival)
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        replica, ok = "", False
        try:
            async for progress in self.driver.run(ParsedRequest(request_id, prompt, params, 0)):
                now = self.loop.time()
                replica = progress.decode_replica or replica
                self.signals.observe(progress, arrival, account.observe(progress, now), now, replica)
                if on_tokens is not None:
                    on_tokens(sum(len(o.token_ids) for o in progress.outputs))
            ok = True
        finally:
            self.signals.finished(account.completion_tokens, max_tokens, replica, ok=ok)
        timings = account.timings(self.loop.time())
        if account.completion_tokens != max_tokens:
            raise RuntimeError(f"request {request_id}: {account.completion_tokens} of {max_tokens} tokens")
        return timings

    def replica_count(self, pool: str) -> int:
        return len(self.driver.prefill if pool == "prefill" else self.driver.decode)

    def decisions(self, pool: str) -> list[Decision]:
        return list(self.scalers[pool].history)

    @asynccontextmanager
    async def running(self) -> AsyncIterator[MockCluster]:
        """Starts the initial replicas (at once), the KV feed and the scaling loops; on leaving stops them all."""
        for pool in self.pools:
            for _ in range(self._initial.get(pool, 0)):
                self._starting[pool].append(self._spawn(self._start(pool, 0.0)))
        await asyncio.gather(*(t for tasks in self._starting.values() for t in list(tasks)))
        feed = self._spawn(self.driver.feed.run(self.driver.replicas, self.driver.settings.kv_events_interval_s))
        loops = [self._spawn(s.run()) for s in self.scalers.values()] if self.autoscale else []
        try:
            yield self
        finally:
            for task in [feed, *loops, *self._tasks]:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            for replica in self.driver.replicas():
                await replica.api.shutdown()
