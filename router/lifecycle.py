"""One request through the cluster, as the router drives it (DESIGN.md section 2). Disaggregated, n == 1:

  0. Route. routing.Routing plans the request (no replica is asked): decode candidates in policy order, and
     either a prefill replica or the reason the decode replica prefills the prompt itself (conditional
     disaggregation: a short uncached prompt, a saturated or empty prefill pool).
  1. Reserve. Decode replicas are asked in the plan's order until one holds blocks for the prompt and returns
     a transfer descriptor. When none has room the request waits (polling, re-ranked each round) up to
     queue_timeout_s, and at most max_queued_requests requests wait at once; past either, RESOURCE_EXHAUSTED.
  2. Prefill. The planned prefill replica computes the prompt, reusing its prefix cache, and pushes the KV of
     each layer into the descriptor as soon as it is written; it answers with the first token once every
     decode rank has acknowledged its data.
  3. Decode. The decode replica admits the request with that first token and streams its outputs back; each
     engine step's outputs travel decode replica -> router as one Ray message, then to the client.
  4. End. A stop, a length limit or an error ends the stream; a client that goes away or an Abort cancels the
     driving task, and every replica the request touched is told to abort it (each frees its blocks).

  Failure: a transfer that fails, expires or is aborted leaves nothing held on either side (the connectors
  clean up); the router then lets the decode replica prefill the prompt itself (step L below). A replica that
  dies leaves its pool and the request ends UNAVAILABLE.

Colocated mode, n > 1, conditional disaggregation and that fallback take the local path (L): one decode
replica's generate() prefills and decodes, streaming the same way. Every call carries the tenant's cache salt.
The KV feed (kv_feed.py) polls every replica's KV events and load beside all this, off the request path.

Each step is one call on a replica's contract (replica/contract.py): step 1 DecodeReplicaAPI.reserve, step 2
PrefillReplicaAPI.prefill, step 3 DecodeReplicaAPI.decode, step L DecodeReplicaAPI.generate, step 4
ReplicaAPI.abort. In a cluster replica/remote.py makes each a Ray call; in tests router/mock_replicas.py answers."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Generic, TypeVar

from tandem.engine.output_processor import RequestOutput
from tandem.kv_transfer.descriptor import TransferDescriptor, TransferFailedError
from tandem.replica.contract import DecodeReplicaAPI, PrefillReplicaAPI, ReplicaInfo
from tandem.router.kv_feed import KVFeed
from tandem.router.policy import ReplicaLoad
from tandem.router.request_parsing import ParsedRequest
from tandem.router.routing import PREFILL_POOL, RoutePlan, Routing, RoutingSettings

_log = logging.getLogger(__name__)
RETRY_INTERVAL_S = 0.02
API = TypeVar("API", PrefillReplicaAPI, DecodeReplicaAPI)
T = TypeVar("T")


class NoCapacityError(RuntimeError):
    """No replica had room within the queue's limits (gRPC RESOURCE_EXHAUSTED)."""


class NoReplicaError(RuntimeError):
    """The pool has no live replica (gRPC UNAVAILABLE)."""


class ReplicaLostError(RuntimeError):
    """A replica serving the request died (gRPC UNAVAILABLE); the router no longer routes to it."""


def is_replica_death(error: BaseException) -> bool:
    """Whether error says the replica's actor is gone (Ray's RayActorError and its subclasses)."""
    try:
        from ray.exceptions import RayActorError
    except ImportError:  # the driver also runs over mock replicas without Ray
        return False
    return isinstance(error, RayActorError)


@dataclass
class Replica(Generic[API]):
    """A replica as the router sees it: the contract it answers (PrefillReplicaAPI or DecodeReplicaAPI), its
    static info (None: not known, e.g. a test's mock), and the router's load counters for it."""

    name: str
    pool: str
    api: API
    info: ReplicaInfo | None = None
    load: ReplicaLoad = None

    def __post_init__(self) -> None:
        self.load = self.load or ReplicaLoad(self.name)


@dataclass(frozen=True)
class DriverSettings:
    mode: str = "disaggregated"
    max_queued_requests: int = 256
    queue_timeout_s: float = 30.0
    routing: RoutingSettings = field(default_factory=RoutingSettings)
    kv_events_interval_s: float = 0.05  # how often the router polls every replica's KV events and load


@dataclass
class Progress:
    """What the driver reports as the request moves: outputs to forward, and facts for usage and timings."""

    outputs: list[RequestOutput]
    prefill_replica: str = ""
    decode_replica: str = ""
    prefill_route: str = ""  # routing.PREFILL_POOL or the reason the decode replica prefilled
    num_cached_tokens: int | None = None  # the prefill replica's cache hits (disaggregated)
    prefill_s: float = 0.0  # from the replica call to the first token (the parts below included)
    queue_s: float = 0.0
    transfer_s: float = 0.0  # the KV transfer's tail after the prefill replica sampled (disaggregated)
    admission_s: float = 0.0  # the prefill replica's answer to the decode replica's first token (disaggregated)


class RequestDriver:
    def __init__(self, prefill: list[Replica[PrefillReplicaAPI]], decode: list[Replica[DecodeReplicaAPI]],
                 settings: DriverSettings, *, block_size: int | None = None):
        """block_size: the replicas' KV block size in tokens (None: read from their info, else 16)."""
        self.prefill = prefill
        self.decode = decode
        self.settings = settings
        if block_size is None:
            block_size = next((r.info.block_size for r in prefill + decode if r.info is not None), 16)
        self.routing = Routing(settings.routing, block_size)
        self.feed = KVFeed(self.routing.indexes)
        self.num_queued = 0
        self.lost: list[str] = []  # replicas found dead, no longer routed to
        self._replicas = {r.name: r for r in prefill + decode}

    @property
    def num_fallbacks(self) -> int:
        """Requests whose transfer failed and that the decode replica prefilled instead."""
        return self.routing.decisions[("decode_replica", "transfer_failed")]

    def replicas(self) -> list[Replica]:
        """Every replica routed to (what the KV feed polls)."""
        return self.prefill + self.decode

    def remove(self, name: str) -> bool:
        """Stops routing to a replica (dead, or leaving its pool) and forgets what the index held for it.
        Returns whether it was in a pool."""
        replica = self._replicas.pop(name, None)
        if replica is None:
            return False
        (self.prefill if replica.pool == "prefill" else self.decode).remove(replica)
        self.routing.forget_replica(replica.pool, name)
        self.feed.forget(name)
        return True

    def add(self, replica: Replica) -> None:
        """Starts routing to a ready replica."""
        if replica.name in self._replicas:
            raise ValueError(f"replica {replica.name} is already routed to")
        self._replicas[replica.name] = replica
        (self.prefill if replica.pool == "prefill" else self.decode).append(replica)

    def _prefill(self, load: ReplicaLoad) -> Replica[PrefillReplicaAPI]:
        return self._replicas[load.name]

    def _decode(self, load: ReplicaLoad) -> Replica[DecodeReplicaAPI]:
        return self._replicas[load.name]

    async def run(self, request: ParsedRequest) -> AsyncIterator[Progress]:
        """Yields Progress until the request's last output. Raises InvalidRequest-like ValueErrors from the
        replicas, NoCapacityError, NoReplicaError, or Ray's errors for a dead replica."""
        if not self.decode:
            raise NoReplicaError("no ready replica in the decode pool")
        local = "colocated" if self.settings.mode == "colocated" else "n_gt_1" if request.params.n > 1 else None
        plan = self.routing.plan(request.prompt_token_ids, prefill=[r.load for r in self.prefill],
                                 decode=[r.load for r in self.decode], local_reason=local,
                                 cache_salt=request.cache_salt, session=request.session_id)
        touched: list[tuple[Replica, str]] = []  # (replica, the request's id there)
        try:
            if plan.prefill is None:
                replica = self._decode(next(plan.decode))
                self.routing.record(plan, prefill=None, decode=replica.name, session=request.session_id)
                async for progress in self._local(request, replica, plan.reason, touched):
                    yield progress
                return
            async for progress in self._disaggregated(request, plan, touched):
                yield progress
        finally:
            for replica, _ in touched:
                replica.load.in_flight -= 1
            await asyncio.shield(self._abort_everywhere(request.request_id, touched))

    async def _call(self, replica: Replica, call: Awaitable[T]) -> T:
        """Awaits a call on replica; if the replica died, stops routing to it and raises ReplicaLostError."""
        try:
            return await call
        except Exception as e:
            self._check_death(replica, e)
            raise

    async def _items(self, replica: Replica, stream: AsyncIterator[list[RequestOutput]]
                     ) -> AsyncIterator[list[RequestOutput]]:
        """The items of a streaming call on replica, with the replica's death handled as in _call."""
        while True:
            try:
                item = await stream.__anext__()
            except StopAsyncIteration:
                return
            except Exception as e:
                self._check_death(replica, e)
                raise
            yield item

    def _check_death(self, replica: Replica, error: Exception) -> None:
        if not is_replica_death(error):
            return
        if self.remove(replica.name):
            self.lost.append(replica.name)
            _log.error("replica %s died; no longer routing to it: %s", replica.name, error)
        raise ReplicaLostError(f"replica {replica.name} died while serving the request") from None

    async def _abort_everywhere(self, request_id: str, touched: list[tuple[Replica, str]]) -> None:
        """Tells every replica the request touched to drop it (a no-op where it finished)."""
        results = await asyncio.gather(*(replica.api.abort(rid) for replica, rid in touched), return_exceptions=True)
        for (replica, _), result in zip(touched, results):
            if isinstance(result, BaseException):  # a dead replica holds nothing any more
                _log.warning("abort of %s on %s failed: %r", request_id, replica.name, result)

    @staticmethod
    def _use(replica: Replica, request_id: str, touched: list[tuple[Replica, str]]) -> None:
        replica.load.in_flight += 1
        touched.append((replica, request_id))

    async def _reserve(self, request: ParsedRequest, plan: RoutePlan,
                       touched: list[tuple[Replica, str]]
                       ) -> tuple[Replica[DecodeReplicaAPI], TransferDescriptor, float]:
        start = time.monotonic()
        queued = False
        order = plan.decode
        try:
            while True:
                for load in order:
                    replica = self._decode(load)
                    descriptor = await self._call(replica, replica.api.reserve(
                        request.request_id, request.prompt_token_ids, request.params, priority=request.priority,
                        cache_salt=request.cache_salt,  # senders: the planned prefill replica's KV agents
                        senders=info.kv_addresses if (info := self._prefill(plan.prefill).info) else ()))
                    if descriptor is not None:
                        replica.load.refusals = 0
                        self._use(replica, request.request_id, touched)
                        return replica, descriptor, time.monotonic() - start
                    replica.load.refusals += 1
                if not queued:
                    if self.num_queued >= self.settings.max_queued_requests:
                        raise NoCapacityError(f"no decode replica has room for the prompt and "
                                              f"{self.num_queued} requests are already queued")
                    queued = True
                    self.num_queued += 1
                if time.monotonic() - start > self.settings.queue_timeout_s:
                    raise NoCapacityError(f"no decode replica had room for the prompt within "
                                          f"{self.settings.queue_timeout_s:g} s")
                await asyncio.sleep(RETRY_INTERVAL_S)
                if not self.decode:
                    raise NoReplicaError("no ready replica in the decode pool")
                order = self.routing.pickers["decode"].rank_decode([r.load for r in self.decode])
        finally:
            if queued:
                self.num_queued -= 1

    async def _disaggregated(self, request: ParsedRequest, plan: RoutePlan,
                             touched: list[tuple[Replica, str]]) -> AsyncIterator[Progress]:
        prefill = self._prefill(plan.prefill)
        # Counted as queued on the prefill replica from the decision on, so that a burst of requests spreads
        # by load before any of them reaches it.
        prefill.load.queued_prefill_tokens += plan.uncached_tokens
        queued = plan.uncached_tokens
        try:
            decode, descriptor, queue_s = await self._reserve(request, plan, touched)
            self.routing.record(plan, prefill=prefill.name, decode=decode.name, session=request.session_id)
            self._use(prefill, request.request_id, touched)
            start = time.monotonic()
            result = await self._call(prefill, prefill.api.prefill(
                request.request_id, request.prompt_token_ids, request.params, descriptor,
                priority=request.priority, cache_salt=request.cache_salt))
            prefill.load.queued_prefill_tokens -= queued
            queued = 0
            answered = time.monotonic()
            stream = decode.api.decode(request.request_id, result.first_token)
            first = True
            async for outputs in self._items(decode, stream):
                if first:
                    now = time.monotonic()
                    yield Progress(outputs, prefill_replica=prefill.name, decode_replica=decode.name,
                                   prefill_route=PREFILL_POOL, num_cached_tokens=result.num_cached_tokens,
                                   prefill_s=now - start, queue_s=queue_s, transfer_s=result.transfer_s,
                                   admission_s=now - answered)
                    first = False
                else:
                    yield Progress(outputs)
        except TransferFailedError as e:
            # Nothing is held on either side now; the decode replica prefills the prompt itself.
            _log.warning("request %s: %s; prefilling on a decode replica instead", request.request_id, e)
            self.routing.count("decode_replica", "transfer_failed")
            async for progress in self._local(request, decode, "transfer_failed", touched,
                                              local_id=f"{request.request_id}.local"):
                yield progress
        finally:
            prefill.load.queued_prefill_tokens -= queued

    async def _local(self, request: ParsedRequest, replica: Replica[DecodeReplicaAPI], reason: str,
                     touched: list[tuple[Replica, str]], *, local_id: str | None = None) -> AsyncIterator[Progress]:
        """The decode replica prefills and decodes. local_id: the id on the replica when it differs (a retry
        runs under its own id: the failed reservation's may still be winding down there)."""
        rid = local_id or request.request_id
        start = time.monotonic()
        self._use(replica, rid, touched)
        stream = replica.api.generate(
            rid, request.prompt_token_ids, request.params, priority=request.priority, cache_salt=request.cache_salt)
        first = True
        async for outputs in self._items(replica, stream):
            if rid != request.request_id:
                outputs = [dataclasses.replace(o, request_id=request.request_id) for o in outputs]
            if first:
                yield Progress(outputs, decode_replica=replica.name, prefill_route=reason,
                               prefill_s=time.monotonic() - start)
            else:
                yield Progress(outputs)
            first = False
