"""The control plane of one running cluster: a named Ray actor that owns every placement group, replica actor and
the router of a manifest. `tandem up` creates it and calls start(); `tandem status` and `tandem down` find it by
name (`<manifest name>-controller` in the manifest's namespace) from any process connected to the Ray cluster.

start() places one placement group per replica (one bundle holding every rank's resources, so a replica's ranks
share a node), starts the replica actor inside it holding the bundle's GPUs (it spawns its ranks as child
processes on that node and gives each its share of those GPUs as CUDA_VISIBLE_DEVICES), waits until
every replica has loaded its model, then starts the router with their handles. Progress lines accumulate in
log() for the launcher to print.

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
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from tandem.cluster.manifest import Manifest
from tandem.cluster.replica_plans import ReplicaPlan, absolute_model, replica_plans, transfer_config
from tandem.replica.contract import DecodeReplicaAPI, PrefillReplicaAPI, ReadyReplica, ReplicaInfo
from tandem.replica.remote import remote_replica
from tandem.router.lifecycle import DriverSettings
from tandem.router.limits import ServingLimits
from tandem.router.policy import RoutingWeights
from tandem.router.routing import RoutingSettings

_log = logging.getLogger(__name__)
STATS_TIMEOUT_S = 10.0


def driver_settings(manifest: Manifest) -> DriverSettings:
    """The manifest's router section as the router's request driver takes it."""
    r = manifest.router
    routing = RoutingSettings(policy=r.policy, weights=RoutingWeights(**r.weights.model_dump()),
                              local_prefill_max_tokens=r.local_prefill_max_tokens,
                              prefill_saturation_tokens=r.prefill_saturation_tokens,
                              session_affinity=r.session_affinity, affinity_max_gap=r.affinity_max_gap)
    return DriverSettings(mode=manifest.mode, max_queued_requests=r.max_queued_requests,
                          queue_timeout_s=r.queue_timeout_s, routing=routing,
                          kv_events_interval_s=r.kv_events_interval_s)


def serving_limits(manifest: Manifest) -> ServingLimits:
    """The manifest's request limits, deadline and tenant limits as the router's front doors take them."""
    return ServingLimits(request_timeout_s=manifest.router.request_timeout_s, limits=manifest.router.limits,
                         tenants=manifest.auth.tenants, default_tenant=manifest.auth.default_tenant)


def controller_name(cluster_name: str) -> str:
    return f"{cluster_name}-controller"


@dataclass
class ReplicaEntry:
    """One replica the controller started: its plan, placement group, Ray actor (None while placing) and the
    typed view of that actor (replica/remote.py), and its info once ready."""

    plan: ReplicaPlan
    pg: Any  # ray.util.placement_group.PlacementGroup
    actor: Any = None  # the replica's Ray actor handle
    api: PrefillReplicaAPI | DecodeReplicaAPI | None = None
    info: ReplicaInfo | None = None

    @property
    def name(self) -> str:
        return self.plan.name

    @property
    def pool(self) -> str:
        return self.plan.pool


class Controller:
    def __init__(self, manifest: Manifest, *, placement_timeout_s: float = 120.0, ready_timeout_s: float = 600.0,
                 started_ray: bool = False):
        self.manifest = manifest
        self.placement_timeout_s = placement_timeout_s
        self.ready_timeout_s = ready_timeout_s
        self.started_ray = started_ray  # `tandem down` stops the local Ray it started
        self.replicas: list[ReplicaEntry] = []
        self.router = None
        self.endpoint: str | None = None
        self.http_endpoint: str | None = None
        self.state = "starting"
        self._lines: list[str] = []
        self._transfer_secret = secrets.token_bytes(32)  # shared by every replica's KV agents, this cluster only

    def _say(self, line: str) -> None:
        _log.info(line)
        self._lines.append(f"[{time.strftime('%H:%M:%S')}] {line}")

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
            plans = replica_plans(self.manifest)
            await asyncio.gather(*(self._place(plan) for plan in plans))
            self._say(f"starting {len(plans)} replica(s): {', '.join(p.name for p in plans)}")
            await asyncio.gather(*(self._start_replica(r) for r in self.replicas))
            await self._start_router()
        except BaseException as e:
            self.state = "failed"
            self._say(f"start failed: {e}")
            await self.shutdown()
            self.state = "failed"
            raise
        self.state = "serving"
        return {"grpc": self.endpoint, "http": self.http_endpoint}

    async def _place(self, plan: ReplicaPlan) -> None:
        pg = placement_group([plan.bundle], strategy="STRICT_PACK", name=f"{self.manifest.name}-{plan.name}")
        self.replicas.append(ReplicaEntry(plan, pg))
        self._say(f"{plan.name}: placing {len(plan.bundles)} rank(s) x {plan.bundles[0]} on one node")
        try:
            await asyncio.wait_for(pg.ready(), self.placement_timeout_s)
        except asyncio.TimeoutError:
            raise RuntimeError(
                f"{plan.name}: Ray could not place {len(plan.bundles)} rank(s) x {plan.bundles[0]} on one node "
                f"within {self.placement_timeout_s:g} s; the cluster has {ray.available_resources()} available. "
                f"Add nodes with these resources or lower pools.{plan.pool}.resources") from None

    async def _start_replica(self, entry: ReplicaEntry) -> None:
        from tandem.decode_worker.replica import DecodeReplica
        from tandem.prefill_worker.replica import PrefillReplica

        plan = entry.plan
        colocated = self.manifest.mode == "colocated"
        cls = PrefillReplica if plan.pool == "prefill" else DecodeReplica
        transfer = None if colocated else transfer_config(self.manifest, self._transfer_secret)
        strategy = PlacementGroupSchedulingStrategy(entry.pg, placement_group_bundle_index=0)
        # The actor holds the bundle's GPUs (Ray tells it their IDs) and hands each rank its share.
        actor = ray.remote(cls).options(
            name=f"{self.manifest.name}-{plan.name}", namespace=self.manifest.ray.namespace, num_cpus=0,
            num_gpus=plan.bundle.get("GPU", 0), max_concurrency=1000, scheduling_strategy=strategy,
        ).remote(plan.name, plan.spec, transfer)
        entry.actor, entry.api = actor, remote_replica(plan.pool, actor)
        try:
            entry.info = await asyncio.wait_for(entry.api.ready(), self.ready_timeout_s)
        except asyncio.TimeoutError:
            raise RuntimeError(f"{plan.name} did not become ready within {self.ready_timeout_s:g} s") from None
        except ray.exceptions.RayActorError as e:
            raise RuntimeError(f"{plan.name} failed to start: {_cause(e)}") from None
        gpus = [r.visible_gpus for r in entry.info.ranks if r.visible_gpus]
        attention = entry.info.ranks[0].attention if entry.info.ranks else "?"
        self._say(f"{plan.name} ready on node {entry.info.node} ({entry.info.device}, attention {attention}"
                  + (f", GPUs {' | '.join(gpus)}" if gpus else "") + f"): {entry.info.kv_blocks_total} KV blocks; "
                  + "; ".join(entry.info.layout))

    async def _start_router(self) -> None:
        from tandem.router.router_actor import RouterActor

        router = self.manifest.router
        settings = driver_settings(self.manifest)
        self.router = ray.remote(RouterActor).options(
            name=f"{self.manifest.name}-router", namespace=self.manifest.ray.namespace, num_cpus=0,
            max_concurrency=10000,  # on the controller's node, which is the node `tandem up` ran on
            scheduling_strategy=NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False),
        ).remote(absolute_model(self.manifest), settings)
        ready = [ReadyReplica(r.name, r.pool, r.api, r.info) for r in self.replicas]
        listen, tls = self.manifest.listen, self.manifest.tls
        try:
            endpoints = await self.router.start.remote(ready, listen.grpc, listen.http,
                                                       self.manifest.auth.resolve() or None,
                                                       limits=serving_limits(self.manifest),
                                                       tls=None if tls is None else tls.router_config())
        except ray.exceptions.RayError as e:
            raise RuntimeError(f"the router failed to start: {_cause(e)}") from None
        self.endpoint, self.http_endpoint = endpoints["grpc"], endpoints["http"]
        http = f", HTTP on {self.http_endpoint}" if self.http_endpoint else ""
        auth = f", API keys for {len(self.manifest.auth.api_keys)} tenant(s)" if self.manifest.auth.api_keys else ""
        secure = "" if tls is None else ", mutual TLS" if tls.client_ca_file else ", TLS"
        self._say(f"router serving gRPC on {self.endpoint}{http} ({self.manifest.mode}, policy {router.policy}"
                  f"{auth}{secure})")

    # -- status ----------------------------------------------------------------------------------------

    async def status(self) -> dict:
        """Pools, replicas (state, ranks, queues, KV use) and the router, as one JSON-friendly dict."""
        replicas = await asyncio.gather(*(self._replica_status(r) for r in self.replicas))
        router = {"state": "absent"}
        if self.router is not None:
            try:
                router = dataclasses.asdict(await asyncio.wait_for(self.router.stats.remote(), STATS_TIMEOUT_S))
            except (asyncio.TimeoutError, ray.exceptions.RayError) as e:
                router = {"state": "unreachable", "error": str(_cause(e))}
        pools = {}
        for name, pool in self.manifest.pool_items():
            mine = [r for r in replicas if r["pool"] == name]
            pools[name] = {"parallelism": pool.parallelism.model_dump(), "replicas": pool.replicas.model_dump(),
                           "ready": sum(r["state"] == "ready" for r in mine), "count": len(mine)}
        return {"name": self.manifest.name, "state": self.state, "mode": self.manifest.mode,
                "model": self.manifest.model, "endpoints": {"grpc": self.endpoint, "http": self.http_endpoint},
                "pools": pools,
                "replicas": replicas, "router": router}

    async def _replica_status(self, entry: ReplicaEntry) -> dict:
        info = entry.info
        base = {"name": entry.name, "pool": entry.pool, "node": info.node if info else None,
                "node_id": info.node_id if info else None, "ranks": list(info.layout) if info else [],
                "device": info.device if info else None,
                "rank_placements": [dataclasses.asdict(r) for r in info.ranks] if info else []}
        if entry.api is None:
            return base | {"state": "placing"}
        try:
            stats = await asyncio.wait_for(entry.api.stats(), STATS_TIMEOUT_S)
        except asyncio.TimeoutError:
            return base | {"state": "unresponsive"}
        except ray.exceptions.RayError as e:
            return base | {"state": "dead", "error": str(_cause(e))}
        return base | dataclasses.asdict(stats)

    async def replica_handles(self) -> dict[str, Any]:
        """Each replica's Ray actor handle by name (for tests and operators' scripts)."""
        return {r.name: r.actor for r in self.replicas}

    # -- stop ------------------------------------------------------------------------------------------

    async def shutdown(self) -> None:
        """Stops the router (no new requests), then every replica (their ranks exit), then frees the placement
        groups. Idempotent."""
        self.state = "stopping"
        if self.router is not None:
            try:
                await asyncio.wait_for(self.router.stop.remote(), 10)
            except Exception as e:
                _log.warning("router stop: %r", e)
            ray.kill(self.router)
            self.router = None
        async def stop(entry: ReplicaEntry) -> None:
            if entry.actor is not None:
                try:
                    await asyncio.wait_for(entry.api.shutdown(), 30)
                except Exception as e:
                    _log.warning("%s shutdown: %r", entry.name, e)
                ray.kill(entry.actor)
                entry.actor = entry.api = None
            remove_placement_group(entry.pg)
        await asyncio.gather(*(stop(r) for r in self.replicas))
        self.replicas = []
        self.state = "stopped"
        self._say("stopped")


def _cause(error: BaseException) -> BaseException | str:
    """The user-facing reason inside a Ray error (its cause's message when Ray wrapped one)."""
    cause = getattr(error, "cause", None)
    if cause is not None:
        return cause
    return str(error).strip().splitlines()[-1] if str(error).strip() else repr(error)

