"""Every replica of a running cluster, as the controller (cluster/controller.py) keeps them on Ray: placing,
starting, serving, draining, replacing the dead. It is the Actuator of the pools' autoscaling loops
(cluster/pool_scaler.py) and runs the health monitor.

A replica's life: "placing" (its placement group waits for Ray to find a node; if that takes more than a moment,
Ray's autoscaler is asked for the resources of every replica wanted, ray.autoscaler.sdk.request_resources, so
`ray up` and KubeRay clusters add nodes), "starting" (its actor loads the model), "ready" (the router routes to
it), then "draining" (no new requests; it finishes what it holds, or after drain_timeout_s it is stopped and its
requests continue elsewhere by replay) and gone, or "dead" (found dead by the monitor or the router) and gone.
A replica Ray cannot place within resource_timeout_s is given up: the pool's shortfall is reported in `tandem
status` and logged, the request to Ray's autoscaler is withdrawn, and the pool asks for no more replicas until
the cluster's resources grow. Once asked, Ray's autoscaler keeps the nodes that hold what it was asked for (a
request_resources call stands until the next one), so every replica that goes (drained, given up, dead, stopped
with the cluster) is taken out of the request at once: its node can then go idle and be removed.

Health: every HEARTBEAT_S each ready replica answers health() within HEARTBEAT_TIMEOUT_S (it answers without waiting
for a running engine step, so a long step is not mistaken for a hang), or it is dead (its actor died, its engine
failed, a rank process died, or it stopped answering): it leaves routing, is killed, and a new
one is started while its pool has fewer than it wants (within min/max).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from tandem.cluster.manifest import Manifest
from tandem.cluster.pool_scaler import PoolCounts
from tandem.cluster.replica_plans import ReplicaPlan, replica_plan, transfer_config
from tandem.replica.contract import DecodeReplicaAPI, PrefillReplicaAPI, ReadyReplica, ReplicaInfo
from tandem.replica.remote import remote_replica
from tandem.router.pool_signals import PoolLoad

_log = logging.getLogger(__name__)
STATS_TIMEOUT_S = 10.0
HEARTBEAT_S = 1.0
HEARTBEAT_TIMEOUT_S = 3.0  # a replica silent this long is dead: detection within HEARTBEAT_S + this
ASK_RAY_AFTER_S = 2.0  # a placement group still pending after this: ask Ray's autoscaler for the resources


@dataclass
class ReplicaEntry:
    """One replica the controller started: its plan, placement group, Ray actor (None while placing), the typed
    view of that actor (replica/remote.py), its info once ready, and where it is in its life."""

    plan: ReplicaPlan
    pg: Any  # ray.util.placement_group.PlacementGroup
    actor: Any = None
    api: PrefillReplicaAPI | DecodeReplicaAPI | None = None
    info: ReplicaInfo | None = None
    state: str = "placing"  # placing | starting | ready | draining | dead
    since: float = field(default_factory=time.monotonic)
    created: float = field(default_factory=time.monotonic)
    task: asyncio.Task | None = None  # what is placing/starting/draining it

    @property
    def name(self) -> str:
        return self.plan.name

    @property
    def pool(self) -> str:
        return self.plan.pool

    def become(self, state: str) -> None:
        self.state, self.since = state, time.monotonic()


@dataclass
class Shortfall:
    """Resources a pool asked Ray for and did not get: what one replica needs, how many replicas, since when."""

    bundle: dict[str, float]
    replicas: int
    since: float
    cluster: dict[str, float]  # the cluster's resources then: asking again once they grow
    placed: int = 0  # the pool's replicas holding resources then: fewer since (one died or left) frees room


class ReplicaSet:
    def __init__(self, manifest: Manifest, secret: bytes, say: Callable[[str], None], *,
                 placement_timeout_s: float = 120.0, ready_timeout_s: float = 600.0):
        self.manifest, self.say = manifest, say
        self.placement_timeout_s, self.ready_timeout_s = placement_timeout_s, ready_timeout_s
        self.transfer = None if manifest.mode == "colocated" else transfer_config(manifest, secret)
        self.entries: list[ReplicaEntry] = []
        self.router: Any = None  # the router actor, once it serves: replicas that become ready join it
        self.wanted = {name: pool.replicas.start for name, pool in manifest.pool_items()}
        self.shortfalls: dict[str, Shortfall] = {}
        self.replaced = 0
        self._indexes = {name: itertools.count() for name, _ in manifest.pool_items()}
        self._asked: list[dict[str, float]] | None = None  # what request_resources was last given
        self.resource_requests = 0  # times Ray's autoscaler was told what the replicas need
        self.startup_s: dict[str, float] = {}  # pool -> how long its last replica took to serve, seconds
        self.on_ready: Callable[[str, float], None] | None = None  # (pool, seconds from decision to serving)

    # -- start -------------------------------------------------------------------------------------------

    async def start_initial(self) -> None:
        """Places and starts every pool's initial replicas, all at once; raises (naming the replica and why)
        if one fails. The router is not told: it starts with them (ReadyReplica list)."""
        entries = [self._new_entry(pool) for pool, count in self.wanted.items() for _ in range(count)]
        await asyncio.gather(*(self._place(e, timeout_s=self.placement_timeout_s) for e in entries))
        self.say(f"starting {len(entries)} replica(s): {', '.join(e.name for e in entries)}")
        await asyncio.gather(*(self._start_actor(e) for e in entries))

    def ready(self) -> list[ReadyReplica]:
        return [ReadyReplica(e.name, e.pool, e.api, e.info) for e in self.entries if e.state == "ready"]

    def _new_entry(self, pool: str) -> ReplicaEntry:
        plan = replica_plan(self.manifest, pool, next(self._indexes[pool]))
        pg = placement_group([plan.bundle], strategy="STRICT_PACK", name=f"{self.manifest.name}-{plan.name}")
        entry = ReplicaEntry(plan, pg)
        self.entries.append(entry)
        return entry

    async def _place(self, entry: ReplicaEntry, *, timeout_s: float) -> None:
        plan = entry.plan
        self.say(f"{plan.name}: placing {len(plan.bundles)} rank(s) x {plan.bundles[0]} on one node")
        ready = asyncio.ensure_future(entry.pg.ready())
        done, _ = await asyncio.wait([ready], timeout=min(ASK_RAY_AFTER_S, timeout_s))
        if not done:
            self.ask_ray()
            done, _ = await asyncio.wait([ready], timeout=max(0.0, timeout_s - ASK_RAY_AFTER_S))
        if not done:
            ready.cancel()
            raise RuntimeError(
                f"{plan.name}: Ray could not place {len(plan.bundles)} rank(s) x {plan.bundles[0]} on one node "
                f"within {timeout_s:g} s; the cluster has {ray.available_resources()} available. "
                f"Add nodes with these resources or lower pools.{plan.pool}.resources")
        await ready

    async def _start_actor(self, entry: ReplicaEntry) -> None:
        from tandem.decode_worker.replica import DecodeReplica
        from tandem.prefill_worker.replica import PrefillReplica

        plan = entry.plan
        entry.become("starting")
        cls = PrefillReplica if plan.pool == "prefill" else DecodeReplica
        strategy = PlacementGroupSchedulingStrategy(entry.pg, placement_group_bundle_index=0)
        # The actor holds the bundle's GPUs (Ray tells it their IDs) and hands each rank its share.
        actor = ray.remote(cls).options(
            name=f"{self.manifest.name}-{plan.name}", namespace=self.manifest.ray.namespace, num_cpus=0,
            num_gpus=plan.bundle.get("GPU", 0), max_concurrency=1000, scheduling_strategy=strategy,
        ).remote(plan.name, plan.spec, self.transfer, settle_heap=True, tracing=self.manifest.observability.tracing())
        entry.actor, entry.api = actor, remote_replica(plan.pool, actor,
                                                       token_channel=self.manifest.router.token_channel)
        try:
            entry.info = await asyncio.wait_for(entry.api.ready(), self.ready_timeout_s)
        except asyncio.TimeoutError:
            raise RuntimeError(f"{plan.name} did not become ready within {self.ready_timeout_s:g} s") from None
        except ray.exceptions.RayActorError as e:
            raise RuntimeError(f"{plan.name} failed to start: {cause(e)}") from None
        seconds = time.monotonic() - entry.created
        self.startup_s[plan.pool] = seconds
        if self.on_ready is not None:
            self.on_ready(plan.pool, seconds)
        entry.become("ready")
        gpus = [r.visible_gpus for r in entry.info.ranks if r.visible_gpus]
        attention = entry.info.ranks[0].attention if entry.info.ranks else "?"
        step = entry.info.ranks[0].decode_step if entry.info.ranks else ""
        self.say(f"{plan.name} ready on node {entry.info.node} ({entry.info.device}, attention {attention}"
                 + (f", decode step {step}" if step else "")
                 + (f", GPUs {' | '.join(gpus)}" if gpus else "") + f"): {entry.info.kv_blocks_total} KV blocks; "
                 + "; ".join(entry.info.layout))

    # -- the autoscaler's Actuator -----------------------------------------------------------------------

    def counts(self, pool: str) -> PoolCounts:
        mine = [e.state for e in self.entries if e.pool == pool]
        return PoolCounts(mine.count("ready"), mine.count("placing") + mine.count("starting"), mine.count("draining"))

    async def load(self, pool: str) -> PoolLoad:
        return await self.router.pool_load.remote(pool)

    def start(self, pool: str, count: int) -> None:
        self.wanted[pool] = self.counts(pool).ready + self.counts(pool).starting + count
        for _ in range(count):
            self._launch(self._new_entry(pool))

    def drain(self, pool: str, count: int) -> None:
        counts = self.counts(pool)
        self.wanted[pool] = max(0, counts.ready + counts.starting - count)
        coming = [e for e in self.entries if e.pool == pool and e.state in ("placing", "starting")]
        for entry in coming[::-1][:count]:  # the newest first: the furthest from serving
            self._spawn(entry, self._stop(entry, "not needed any more"))
            count -= 1
        serving = [e for e in self.entries if e.pool == pool and e.state == "ready"]
        for entry in serving[::-1][:count]:
            entry.become("draining")
            self._spawn(entry, self._drain(entry))

    def can_grow(self, pool: str) -> bool:
        """False while the pool's last replicas could not be placed, the cluster has not grown since, and the
        pool holds as many replicas as it did then (a replica that died or left freed the room for one)."""
        shortfall = self.shortfalls.get(pool)
        if shortfall is None:
            return True
        if _grew(ray.cluster_resources(), shortfall.cluster):
            del self.shortfalls[pool]
            return True
        return sum(1 for e in self.entries if e.pool == pool) < shortfall.placed

    def _launch(self, entry: ReplicaEntry) -> None:
        async def launch() -> None:
            autoscaling = self.manifest.pool(entry.pool).autoscaling
            try:
                await self._place(entry, timeout_s=autoscaling.resource_timeout_s)
            except RuntimeError as e:
                self._short(entry, str(e))
                return
            self.shortfalls.pop(entry.pool, None)  # there was room for this one: a shortfall is found anew
            try:
                await self._start_actor(entry)
            except RuntimeError as e:
                self.say(f"{entry.name}: {e}; starting another")
                await self._stop(entry, "failed to start")
                self._replace(entry.pool)
                return
            await self.router.add_replica.remote(ReadyReplica(entry.name, entry.pool, entry.api, entry.info))

        self._spawn(entry, launch())

    def _short(self, entry: ReplicaEntry, error: str) -> None:
        pending = [e for e in self.entries if e.pool == entry.pool and e.state == "placing"]
        placed = sum(1 for e in self.entries if e.pool == entry.pool) - len(pending)
        self.shortfalls[entry.pool] = Shortfall(dict(entry.plan.bundle), len(pending), time.time(),
                                                dict(ray.cluster_resources()), placed)
        self.say(f"{entry.name}: {error}. Pool {entry.pool} serves with what it has and asks for no more "
                 f"until the cluster grows")
        for e in pending:
            self._forget(e)
        self.wanted[entry.pool] = sum(1 for e in self.entries if e.pool == entry.pool)
        self.ask_ray()

    @property
    def asked_bundles(self) -> list[dict[str, float]]:
        """What Ray's autoscaler was last asked for (one bundle per replica), [] before any ask."""
        return list(self._asked or [])

    def ask_ray(self) -> None:
        """Tells Ray's autoscaler what every replica wanted needs (one bundle per replica; replicas given up
        for lack of resources, or gone, are not asked for again; none left: the request is withdrawn). A no-op
        when nothing changed."""
        bundles = [dict(e.plan.bundle) for e in self.entries]
        if bundles == self._asked:
            return
        try:
            from ray.autoscaler.sdk import request_resources

            request_resources(bundles=bundles)
            self._asked = bundles
            self.resource_requests += 1
            _log.info("asked Ray's autoscaler for %d replica bundle(s)", len(bundles))
        except Exception as e:  # no autoscaler API on this Ray: placement just waits
            _log.warning("could not ask Ray's autoscaler for resources: %r", e)

    async def _drain(self, entry: ReplicaEntry) -> None:
        timeout_s = self.manifest.pool(entry.pool).autoscaling.drain_timeout_s
        self.say(f"{entry.name}: draining (no new requests; up to {timeout_s:g} s to finish)")
        left = await self.router.drain_replica.remote(entry.name, timeout_s)
        reason = "drained" if left == 0 else f"drain timeout with {left} request(s) left: they continue elsewhere"
        await self._stop(entry, reason)

    async def _stop(self, entry: ReplicaEntry, reason: str) -> None:
        if entry.api is not None and entry.state not in ("dead",):
            try:
                await asyncio.wait_for(entry.api.shutdown(), 30)
            except Exception as e:
                _log.warning("%s shutdown: %r", entry.name, e)
        self._forget(entry)
        self.say(f"{entry.name}: stopped ({reason})")

    def _forget(self, entry: ReplicaEntry) -> None:
        if entry.actor is not None:
            ray.kill(entry.actor)
            entry.actor = entry.api = None
        remove_placement_group(entry.pg)
        if entry in self.entries:
            self.entries.remove(entry)
            if self._asked is not None:  # Ray's autoscaler would keep a node for it: withdraw its bundle
                self.ask_ray()
        if entry.task is not None and entry.task is not asyncio.current_task():
            entry.task.cancel()

    def _spawn(self, entry: ReplicaEntry, coroutine) -> None:
        entry.task = asyncio.get_running_loop().create_task(coroutine)

    # -- health ------------------------------------------------------------------------------------------

    async def monitor(self) -> None:
        """Heartbeats every ready replica until cancelled; a dead one is removed and replaced."""
        while True:
            ready = [e for e in self.entries if e.state == "ready"]
            verdicts = await asyncio.gather(*(self._heartbeat(e) for e in ready))
            for entry, verdict in zip(ready, verdicts):
                if verdict is not None and entry.state == "ready":
                    await self.declare_dead(entry, verdict)
            await asyncio.sleep(HEARTBEAT_S)

    async def _heartbeat(self, entry: ReplicaEntry) -> str | None:
        """None if the replica is alive, else why it is not."""
        try:
            return await asyncio.wait_for(entry.api.health(), HEARTBEAT_TIMEOUT_S)
        except asyncio.TimeoutError:
            return f"no heartbeat within {HEARTBEAT_TIMEOUT_S:g} s"
        except ray.exceptions.RayError as e:
            return f"its actor died: {cause(e)}"

    async def declare_dead(self, entry: ReplicaEntry, why: str) -> None:
        entry.become("dead")
        self.say(f"{entry.name} is dead ({why}); removing it from routing and starting a replacement")
        try:
            await self.router.remove_replica.remote(entry.name, why)
        except ray.exceptions.RayError as e:
            _log.warning("router could not remove %s: %r", entry.name, e)
        self._forget(entry)
        self._replace(entry.pool)

    def _replace(self, pool: str) -> None:
        counts = self.counts(pool)
        bounds = self.manifest.pool(pool).replicas
        missing = min(self.wanted[pool], bounds.max) - counts.ready - counts.starting
        if missing > 0 and self.can_grow(pool):
            self.replaced += missing
            for _ in range(missing):
                self._launch(self._new_entry(pool))

    # -- status and stop ---------------------------------------------------------------------------------

    async def status(self, entry: ReplicaEntry) -> dict:
        info = entry.info
        base = {"name": entry.name, "pool": entry.pool, "node": info.node if info else None,
                "node_id": info.node_id if info else None, "ranks": list(info.layout) if info else [],
                "device": info.device if info else None, "pid": info.pid if info else None,
                "weights": info.weights if info else None, "kv_dtype": info.kv_dtype if info else None,
                "rank_placements": [dataclasses.asdict(r) for r in info.ranks] if info else [],
                "for_s": round(time.monotonic() - entry.since, 1)}
        if entry.api is None or entry.state in ("placing", "starting"):
            return base | {"state": entry.state}
        try:
            stats = await asyncio.wait_for(entry.api.stats(), STATS_TIMEOUT_S)
        except asyncio.TimeoutError:
            return base | {"state": "unresponsive"}
        except ray.exceptions.RayError as e:
            return base | {"state": "dead", "error": str(cause(e))}
        state = entry.state if stats.state == "ready" else stats.state
        ranks = [p | {"state": "alive" if alive else "dead"}
                 for p, alive in zip(base["rank_placements"], stats.ranks_alive)] or base["rank_placements"]
        return base | dataclasses.asdict(stats) | {"state": state, "rank_placements": ranks}

    async def shutdown(self) -> None:
        for entry in list(self.entries):
            if entry.task is not None:
                entry.task.cancel()

        async def stop(entry: ReplicaEntry) -> None:
            if entry.actor is not None:
                try:
                    await asyncio.wait_for(entry.api.shutdown(), 30)
                except Exception as e:
                    _log.warning("%s shutdown: %r", entry.name, e)
            entry.task = None
            self._forget(entry)

        await asyncio.gather(*(stop(e) for e in list(self.entries)))


def _grew(now: dict[str, float], then: dict[str, float]) -> bool:
    return any(now.get(k, 0.0) > v for k, v in then.items()) or any(k not in then for k in now)


def cause(error: BaseException) -> BaseException | str:
    """The user-facing reason inside a Ray error (its cause's message when Ray wrapped one)."""
    c = getattr(error, "cause", None)
    if c is not None:
        return c
    return str(error).strip().splitlines()[-1] if str(error).strip() else repr(error)
