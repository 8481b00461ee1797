"""The control plane of one running cluster: a named Ray actor that owns every placement group, replica actor and
the router of a manifest. `tandem up` creates it and calls start(); `tandem status` and `tandem down` find it by
name (`<manifest name>-controller` in the manifest's namespace) from any process connected to the Ray cluster.

start() places one placement group per replica (one bundle holding every rank's resources, so a replica's ranks
share a node), starts the replica actor inside it holding the bundle's GPUs (it spawns its ranks as child
processes on that node and gives each its share of those GPUs as CUDA_VISIBLE_DEVICES), waits until
every replica has loaded its model (cluster/replica_set.py), then starts the router with their handles. Progress
lines accumulate in log() for the launcher to print.

Then it runs the control plane: one autoscaling loop per pool whose replicas.min < max (cluster/pool_scaler.py,
reading the router's per-pool signals), the replicas' health monitor (a dead replica leaves routing and is
replaced), and the router's (a dead router is replaced on the same addresses). `tandem scale POOL N|auto` pins a
pool or frees it (scale()).

The KV transfer agents of every replica authenticate each other's messages with one secret per cluster: the
controller makes it when it is created and hands it to each replica actor inside its TransferConfig, through Ray
(never on a command line or in a log line; TransferConfig leaves it out of its repr).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from tandem.cluster.autoscaling import PoolPolicy
from tandem.cluster.manifest import Manifest
from tandem.cluster.pool_pressure import SLO, PoolGauge
from tandem.cluster.pool_scaler import PoolScaler
from tandem.cluster.replica_plans import absolute_model, scheduling_config
from tandem.cluster.replica_set import HEARTBEAT_S, HEARTBEAT_TIMEOUT_S, STATS_TIMEOUT_S, ReplicaSet, cause
from tandem.router.driver_settings import DriverSettings
from tandem.router.limits import ServingLimits
from tandem.router.policy import RoutingWeights
from tandem.router.pool_signals import PoolScaling
from tandem.router.routing import RoutingSettings

_log = logging.getLogger(__name__)
ROUTER_RESTART_TRIES = 10
STANDBY_RETRY_S = 5.0  # after a standby router failed to start or died
GONE_TIMEOUT_S = 5.0  # how long a replaced router may take to die before its successor binds its ports anyway
# Heartbeats in a row the router may leave unanswered (HEARTBEAT_TIMEOUT_S each) before it is taken for hung and
# replaced: one slow answer may be a busy machine (on a 2-core machine a live router was replaced, its requests cut,
# while a test computed beside the cluster), and a dead router is replaced at once anyway.
ROUTER_MISSED_HEARTBEATS = 3
DEFAULT_STARTUP_S = 60.0  # a replica's start-up time until one was measured
MAX_LOG_LINES = 2000  # progress and decision lines kept for `tandem up` and `tandem status --log`


def driver_settings(manifest: Manifest) -> DriverSettings:
    """The manifest's router section as the router's request driver takes it."""
    r = manifest.router
    routing = RoutingSettings(policy=r.policy, weights=RoutingWeights(**r.weights.model_dump()),
                              local_prefill_max_tokens=r.local_prefill_max_tokens,
                              prefill_saturation_tokens=r.prefill_saturation_tokens,
                              session_affinity=r.session_affinity, affinity_max_gap=r.affinity_max_gap,
                              pull_min_blocks=r.prefix_pull_min_blocks)
    return DriverSettings(mode=manifest.mode, max_queued_requests=r.max_queued_requests,
                          queue_timeout_s=r.queue_timeout_s, routing=routing,
                          kv_events_interval_s=r.kv_events_interval_s, max_migrations=r.max_migrations,
                          prefill_queue_tokens=r.prefill_queue_tokens,
                          waiting_room=scheduling_config(manifest, manifest.pools.prefill or manifest.pools.decode),
                          decode_room=scheduling_config(manifest, manifest.pools.decode),
                          lora_runtime_loading=bool(manifest.lora and manifest.lora.runtime_loading),
                          lora_admin_tenants=tuple(manifest.lora.admin_tenants) if manifest.lora else ())


def serving_limits(manifest: Manifest) -> ServingLimits:
    """The manifest's request limits, deadline and tenant limits as the router's front doors take them."""
    from tandem.router.limits import AdmissionSettings

    # Raises ValueError for "slo" admission without slo.ttft_s (`tandem validate` reports it first).
    admission = AdmissionSettings(mode=manifest.router.admission,
                                  ttft_slo_s=getattr(getattr(manifest, "slo", None), "ttft_s", None))
    return ServingLimits(request_timeout_s=manifest.router.request_timeout_s, limits=manifest.router.limits,
                         tenants=manifest.auth.tenants, default_tenant=manifest.auth.default_tenant,
                         admission=admission)


async def _gone(actor: Any, timeout_s: float = GONE_TIMEOUT_S) -> None:
    """Waits until a killed actor is dead (a call to it fails as the actor's death), at most timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            await asyncio.wait_for(actor.stats.remote(), 0.5)
        except ray.exceptions.RayActorError:
            return
        except (asyncio.TimeoutError, ray.exceptions.RayError):
            pass
        await asyncio.sleep(0.1)


def controller_name(cluster_name: str) -> str:
    return f"{cluster_name}-controller"


class Controller:
    def __init__(self, manifest: Manifest, *, placement_timeout_s: float = 120.0, ready_timeout_s: float = 600.0,
                 started_ray: bool = False):
        self.manifest = manifest
        self.started_ray = started_ray  # `tandem down` stops the local Ray it started
        self.router = None
        self.standby = None  # a warm router that takes over when the router dies (_keep_standby)
        self.standby_state = "absent"  # "starting" | "ready" | "absent"
        self._router_generation = 0  # router actors made: names the next one
        self.endpoint: str | None = None
        self.http_endpoint: str | None = None
        self.state = "starting"
        self._lines: list[str] = []
        # One secret shared by every replica's KV agents, this cluster only.
        self.replicas = ReplicaSet(manifest, secrets.token_bytes(32), self._say,
                                   placement_timeout_s=placement_timeout_s, ready_timeout_s=ready_timeout_s)
        self.scalers: dict[str, PoolScaler] = {}
        self._tasks: list[asyncio.Task] = []

    def _say(self, line: str) -> None:
        _log.info(line)
        self._lines.append(f"[{time.strftime('%H:%M:%S')}] {line}")
        del self._lines[:-MAX_LOG_LINES]

    async def log(self, since: int = 0) -> list[str]:
        return self._lines[since:]

    async def info(self) -> dict:
        return {"state": self.state, "endpoint": self.endpoint, "http_endpoint": self.http_endpoint,
                "started_ray": self.started_ray}

    # -- start -----------------------------------------------------------------------------------------

    async def start(self) -> dict:
        """Starts every replica and the router; returns {"grpc": endpoint, "http": endpoint or None}. On failure
        everything started is stopped again and the error says which replica failed and why."""
        try:
            await self.replicas.start_initial()
            await self._start_router()
        except BaseException as e:
            self.state = "failed"
            self._say(f"start failed: {e}")
            await self.shutdown()
            self.state = "failed"
            raise
        self.state = "serving"
        self._start_control()
        return {"grpc": self.endpoint, "http": self.http_endpoint}

    def _start_control(self) -> None:
        """The health monitor and one autoscaling loop per pool, on this actor's event loop."""
        loop = asyncio.get_running_loop()
        self.replicas.router = self.router
        slo = SLO(self.manifest.slo.ttft_s, self.manifest.slo.itl_s)
        for name, pool in self.manifest.pool_items():
            a = pool.autoscaling
            gauge = PoolGauge(name, slo, colocated=self.manifest.mode == "colocated",
                              target_utilization=a.target_utilization, kv_high=a.kv_high,
                              max_num_seqs=pool.engine.max_num_seqs,
                              startup_s=self.replicas.startup_s.get(name, DEFAULT_STARTUP_S))
            policy = PoolPolicy(name, pool.replicas.min, pool.replicas.max, a.policy())
            self.scalers[name] = PoolScaler(name, policy, gauge, self.replicas, time.monotonic,
                                            on_decision=lambda d: self._say(f"autoscale {d.describe()}"))
            if pool.replicas.min < pool.replicas.max:
                self._tasks.append(loop.create_task(self.scalers[name].run()))
                self._say(f"autoscaling pool {name} between {pool.replicas.min} and {pool.replicas.max} replicas "
                          f"(up after {a.up_window_s:g} s over target, down after {a.down_window_s:g} s under)")
        self.replicas.on_ready = self._started
        self._tasks.append(loop.create_task(self.replicas.monitor()))
        self._tasks.append(loop.create_task(self._report_scaling()))
        self._tasks.append(loop.create_task(self._watch_router()))
        self._tasks.append(loop.create_task(self._keep_standby()))

    async def _report_scaling(self) -> None:
        """Tells the router each pool's scaling state every second, for its /metrics."""
        while True:
            states = []
            for name, scaler in self.scalers.items():
                counts = self.replicas.counts(name)
                last = scaler.last
                shortfall = self.replicas.shortfalls.get(name)
                states.append(PoolScaling(name, self.replicas.wanted[name], counts.ready, counts.starting,
                                          counts.draining, scaler.changes, last.action if last else "",
                                          last.reason if last else "", scaler.policy.pinned,
                                          shortfall.replicas if shortfall else 0))
            try:
                if self.router is not None:
                    await asyncio.wait_for(self.router.report_scaling.remote(states), HEARTBEAT_TIMEOUT_S)
            except (asyncio.TimeoutError, ray.exceptions.RayError) as e:  # the router watchdog handles a dead one
                _log.debug("scaling report to the router failed: %r", e)
            await asyncio.sleep(HEARTBEAT_S)

    def _started(self, pool: str, seconds: float) -> None:
        """A replica of pool took seconds from its decision to serving: what the pool's sizing expects next."""
        gauge = self.scalers[pool].gauge
        gauge.startup_s = 0.5 * gauge.startup_s + 0.5 * seconds

    async def scale(self, pool: str, count: int | None) -> str:
        """Pins a pool at count replicas (`tandem scale POOL N`) or hands it back to the autoscaler (None:
        `tandem scale POOL auto`). Returns what was done, for the command to print. Raises ValueError for an
        unknown pool or a negative count."""
        if pool not in self.scalers:
            raise ValueError(f"no pool {pool!r} in this cluster (pools: {', '.join(self.scalers)})")
        scaler = self.scalers[pool]
        scaler.policy.pin(count)
        if count is None:
            bounds = self.manifest.pool(pool).replicas
            if bounds.min == bounds.max:  # no loop runs: hold it at its bound
                scaler.policy.pin(bounds.min)
                await scaler.tick()
                scaler.policy.pin(None)
            message = f"pool {pool}: back to automatic scaling between {bounds.min} and {bounds.max}"
        else:
            await scaler.tick()  # act now, not at the next interval
            message = f"pool {pool}: pinned at {count} replica(s) until `tandem scale {pool} auto`"
        self._say(message)
        return message

    def _new_router(self) -> Any:
        """A router actor that has loaded the tokenizer and config but serves nothing until its start()."""
        from tandem.router.router_actor import RouterActor

        name = f"{self.manifest.name}-router" + (f"-{self._router_generation}" if self._router_generation else "")
        self._router_generation += 1
        return ray.remote(RouterActor).options(
            name=name, namespace=self.manifest.ray.namespace, num_cpus=0,
            max_concurrency=10000,  # on the controller's node, which is the node `tandem up` ran on
            scheduling_strategy=NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False),
        ).remote(absolute_model(self.manifest), driver_settings(self.manifest))

    async def _start_router(self, router: Any = None) -> None:
        """Starts serving on router (None: a new actor). Raises RuntimeError if it cannot."""
        router = router if router is not None else self._new_router()
        ready = self.replicas.ready()
        listen, tls = self.manifest.listen, self.manifest.tls
        try:
            # A replacement router takes the addresses its predecessor had bound (port 0 in the manifest: a free
            # one, the first time), so clients reconnect where they were.
            endpoints = await router.start.remote(ready, self.endpoint or listen.grpc,
                                                  self.http_endpoint or listen.http,
                                                  self.manifest.auth.resolve() or None,
                                                  limits=serving_limits(self.manifest),
                                                  tls=None if tls is None else tls.router_config(),
                                                  tracing=self.manifest.observability.tracing(), settle_heap=True)
        except ray.exceptions.RayError as e:
            ray.kill(router)
            raise RuntimeError(f"the router failed to start: {cause(e)}") from None
        self.router = router
        self.endpoint, self.http_endpoint = endpoints["grpc"], endpoints["http"]
        http = f", HTTP on {self.http_endpoint}" if self.http_endpoint else ""
        auth = f", API keys for {len(self.manifest.auth.api_keys)} tenant(s)" if self.manifest.auth.api_keys else ""
        secure = "" if tls is None else ", mutual TLS" if tls.client_ca_file else ", TLS"
        self._say(f"router serving gRPC on {self.endpoint}{http} ({self.manifest.mode}, policy "
                  f"{self.manifest.router.policy}{auth}{secure})")
        self.replicas.router = self.router

    async def _keep_standby(self) -> None:
        """Keeps a standby router warm: a second router actor on this node, its process started, its modules
        imported and its tokenizer loaded, which a dead router's replacement only has to start serving (about a
        second instead of a new process's several). One that dies is made again."""
        while True:
            standby = self.standby
            if standby is None:
                standby = self.standby = self._new_router()
                self.standby_state = "starting"
            try:
                await standby.warm.remote()
                if self.standby is standby:  # not taken over meanwhile
                    self.standby_state = "ready"
            except ray.exceptions.RayError as e:
                if self.standby is standby:
                    _log.warning("standby router: %s", cause(e))
                    self.standby, self.standby_state = None, "absent"
                await asyncio.sleep(STANDBY_RETRY_S)
                continue
            await asyncio.sleep(HEARTBEAT_S)

    async def _watch_router(self) -> None:
        """Heartbeats the router; one that died, or left ROUTER_MISSED_HEARTBEATS in a row unanswered, is replaced on
        the same addresses by the warm standby (or a new router if there is none), which rebuilds its prefix index
        from the replicas' snapshots (its KV feed starts with none)."""
        missed = 0
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            try:
                await asyncio.wait_for(self.router.stats.remote(), HEARTBEAT_TIMEOUT_S)
                missed = 0
            except asyncio.TimeoutError:
                missed += 1
                _log.warning("router: heartbeat %d unanswered within %g s", missed, HEARTBEAT_TIMEOUT_S)
                if missed >= ROUTER_MISSED_HEARTBEATS:
                    missed = 0
                    await self._replace_router(f"it left {ROUTER_MISSED_HEARTBEATS} heartbeats in a row unanswered "
                                               f"within {HEARTBEAT_TIMEOUT_S:g} s each")
            except ray.exceptions.RayError as e:
                missed = 0
                await self._replace_router(f"it died: {cause(e)}")

    async def _replace_router(self, why: str) -> None:
        self._say(f"router: replacing it ({why})")
        old, self.router = self.router, None
        try:
            ray.kill(old)
        except Exception as e:  # already gone
            _log.info("router kill: %r", e)
        await _gone(old)  # its ports are free before another binds them
        standby, self.standby, self.standby_state = self.standby, None, "absent"  # _keep_standby makes another
        if standby is not None:
            try:
                await self._start_router(standby)
                self._say("router: the standby router took over")
                return
            except RuntimeError as e:
                self._say(f"router: the standby could not take over ({e}); starting a new router")
        for attempt in range(ROUTER_RESTART_TRIES):
            try:
                await self._start_router()
                return
            except RuntimeError as e:  # e.g. its port not free yet
                self._say(f"router restart {attempt + 1} failed: {e}")
                await asyncio.sleep(1.0)
        self.state = "degraded"
        self._say("router: could not be restarted; `tandem down` and `tandem up` the cluster")

    # -- status ----------------------------------------------------------------------------------------

    async def status(self) -> dict:
        """Pools (bounds, desired and current replicas, pending ones, the last scaling decision, shortfalls),
        replicas (state, ranks with node and pid, queues, KV use, requests in flight) and the router, as one
        JSON-friendly dict."""
        entries = list(self.replicas.entries)
        replicas = await asyncio.gather(*(self.replicas.status(e) for e in entries))
        router = {"state": "absent"}
        if self.router is not None:
            try:
                router = dataclasses.asdict(await asyncio.wait_for(self.router.stats.remote(), STATS_TIMEOUT_S))
            except (asyncio.TimeoutError, ray.exceptions.RayError) as e:
                router = {"state": "unreachable", "error": str(cause(e))}
        router["standby"] = self.standby_state
        in_flight = router.get("in_flight", {})
        for replica in replicas:
            replica["in_flight"] = in_flight.get(replica["name"], 0)
        pools = {}
        for name, pool in self.manifest.pool_items():
            counts = self.replicas.counts(name)
            scaler = self.scalers.get(name)
            last = scaler.last if scaler is not None else None
            shortfall = self.replicas.shortfalls.get(name)
            pools[name] = {"parallelism": pool.parallelism.model_dump(), "replicas": pool.replicas.model_dump(),
                           "ready": counts.ready, "pending": counts.starting, "draining": counts.draining,
                           "count": counts.ready + counts.starting, "desired": self.replicas.wanted[name],
                           "autoscaling": pool.replicas.min < pool.replicas.max,
                           "pinned": scaler.policy.pinned if scaler is not None else None,
                           "last_decision": None if last is None else {
                               "action": last.action, "from": last.current, "to": last.desired,
                               "reason": last.reason, "age_s": round(time.monotonic() - last.t, 1),
                               "inputs": dict(last.inputs)},
                           "shortfall": None if shortfall is None else dataclasses.asdict(shortfall)}
        return {"name": self.manifest.name, "state": self.state, "mode": self.manifest.mode,
                "model": self.manifest.model, "endpoints": {"grpc": self.endpoint, "http": self.http_endpoint},
                "pools": pools, "replicas_replaced": self.replicas.replaced,
                "resource_request": {"asks": self.replicas.resource_requests,
                                     "bundles": self.replicas.asked_bundles},
                "replicas": replicas, "router": router}

    async def replica_handles(self) -> dict[str, Any]:
        """Each replica's Ray actor handle by name (for tests and operators' scripts)."""
        return {e.name: e.actor for e in self.replicas.entries if e.actor is not None}

    async def restart_router(self) -> None:
        """Replaces the router actor (a test's or an operator's drill; the monitor does it when it dies)."""
        await self._replace_router("asked to")

    # -- stop ------------------------------------------------------------------------------------------

    async def _drain_router(self, timeout_s: float) -> None:
        self.state = "draining"
        try:
            running = (await asyncio.wait_for(self.router.stats.remote(), GONE_TIMEOUT_S)).active_requests
            self._say(f"draining: {running} request(s) running; no new requests; up to {timeout_s:g} s to finish")
            left = await asyncio.wait_for(self.router.drain.remote(timeout_s), timeout_s + GONE_TIMEOUT_S)
        except Exception as e:
            self._say(f"drain failed ({e!r}); stopping")
            return
        self._say("drained: every request finished" if left == 0 else
                  f"drain timeout (router.drain_timeout_s): {left} request(s) still running are ended")

    async def shutdown(self, drain: bool = False) -> None:
        """Stops the control loops, the router (no new requests), then every replica (their ranks exit), then
        frees the placement groups. Idempotent. drain: first the router drains (router.drain_timeout_s: it admits
        nothing new and running requests may finish), the replicas and control loops still serving it."""
        if drain and self.router is not None and self.state in ("serving", "degraded"):
            await self._drain_router(self.manifest.router.drain_timeout_s)
        self.state = "stopping"
        for task in self._tasks:
            task.cancel()
        self._tasks = []
        if self.router is not None:
            try:
                await asyncio.wait_for(self.router.stop.remote(), 10)
            except Exception as e:
                _log.warning("router stop: %r", e)
            ray.kill(self.router)
            self.router = None
        if self.standby is not None:
            ray.kill(self.standby)
            self.standby, self.standby_state = None, "absent"
        await self.replicas.shutdown()
        self.state = "stopped"
        self._say("stopped")
