"""One request through the cluster, as the router drives it (DESIGN.md section 2). Disaggregated, n == 1:

  0. Route. routing.Routing plans the request (no replica is asked): decode candidates in policy order, and
     either a prefill replica or the reason the decode replica prefills the prompt itself (conditional
     disaggregation: a short uncached prompt, a saturated or empty prefill pool). With late binding
     (DriverSettings.prefill_queue_tokens) a request whose prefill replica has that many tokens queued waits
     here, holding nothing, and is planned again when a prefill queue shortens or the pool changes.
  1. Reserve. Decode replicas are asked in the plan's order until one holds blocks for the prompt and returns
     a transfer descriptor. When none has room it waits in the decode pool's order (policy_queue.DecodeRoom: the
     first polls, re-ranked each round, telling the replicas how long it waited: past preempt_after_s it may
     preempt lower priorities) up to queue_timeout_s, max_queued_requests at once; else RESOURCE_EXHAUSTED.
  2. Prefill. The planned prefill replica computes the prompt, reusing its prefix cache (first pulled from a
     replica holding it, where that pays: prefix_pulls.py), and pushes each layer's KV into the descriptor as
     soon as it is written; it answers with the first token once every decode rank has acknowledged its data.
  3. Decode. The decode replica admits the request with that first token and streams its outputs back; each
     engine step's outputs travel decode replica -> router as one Ray message, then to the client.
  4. End. A stop, a length limit or an error ends the stream; a client that goes away or an Abort cancels the
     driving task, and every replica the request touched is told to abort it (each frees its blocks).

  Failure: a transfer that fails, expires or is aborted leaves nothing held on either side (the connectors
  clean up); the router then lets the decode replica prefill the prompt itself (step L below). A replica that
  dies leaves its pool. A prefill replica that dies in step 2: the decode reservation is aborted and the
  prompt is prefilled again, on another prefill replica or by the decode replica. A decode replica that dies
  in step 3 or L: the request (n == 1) continues on another decode replica by token replay (step M:
  migration.py). Both are bounded by DriverSettings.max_migrations; past it, with no replica left, or for
  n > 1, the request ends UNAVAILABLE.

Colocated mode, n > 1, conditional disaggregation and that fallback take the local path (L): one decode
replica's generate() prefills and decodes, streaming the same way. Every call carries the tenant's cache salt.
The KV feed (kv_feed.py) polls every replica's KV events and load beside all this, off the request path.

Each step is one call on a replica's contract (replica/contract.py): step 1 DecodeReplicaAPI.reserve, step 2
PrefillReplicaAPI.prefill, step 3 DecodeReplicaAPI.decode, step L DecodeReplicaAPI.generate, step M
DecodeReplicaAPI.resume, step 4 ReplicaAPI.abort. In a cluster replica/remote.py makes each a Ray call; in tests
router/mocks/replicas.py answers. Steps 2, 3, L and M carry the request's traceparent when it is traced.

Names. The request keeps the client's id throughout; each attempt (a retry, a migration, step L's fallback) runs
on replicas as its RunKey.replica_id() (run_key.py); outputs reach the client under its id (Replay.forward)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable, TypeVar

from tandem.engine.core.output_processor import RequestOutput
from tandem.kv_transfer.descriptor import TransferDescriptor, TransferFailedError
from tandem.replica.contract import DecodeReplicaAPI, PrefillReplicaAPI
from tandem.router.aborts import Aborts, abort_everywhere
from tandem.router.driver_settings import DriverSettings
from tandem.router.kv_feed import KVFeed
from tandem.router.migration import MIGRATION, PREFILL_DIED, Replay, seeded
from tandem.router.policy import ReplicaLoad
from tandem.router.policy_queue import DecodeRoom
from tandem.router.prefill_waiting_room import PrefillWaitingRoom
from tandem.router.prefix_pulls import PrefixPulls
from tandem.router.replicas import (NoCapacityError, NoReplicaError, Replica, ReplicaLostError, ReplicaPools,
                                    is_replica_death)
from tandem.router.request_parsing import ParsedRequest
from tandem.router.routing import PREFILL_POOL, RoutePlan, Routing
from tandem.router.run_key import RunKey

_log = logging.getLogger(__name__)
RETRY_INTERVAL_S = 0.02
T = TypeVar("T")


@dataclass
class Progress:
    """What the driver reports as the request moves: outputs to forward, and facts for usage and timings."""

    outputs: list[RequestOutput]
    prefill_replica: str = ""
    decode_replica: str = ""
    prefill_route: str = ""  # routing.PREFILL_POOL or the reason the decode replica prefilled
    num_cached_tokens: int | None = None  # the prefill replica's cache hits (disaggregated)
    prefill_s: float = 0.0  # from the replica call to the first token (the parts below included)
    queue_s: float = 0.0  # waiting at the router for a decode replica with room (disaggregated)
    prefill_queue_s: float = 0.0  # of prefill_s, the prefill replica's queue (PrefillResult.queue_s)
    transfer_s: float = 0.0  # the KV transfer's tail after the prefill replica sampled (disaggregated)
    admission_s: float = 0.0  # the prefill replica's answer to the decode replica's first token (disaggregated)


# Builds the first progress a request forwards from its outputs and the replica that streamed them.
FirstProgress = Callable[[list[RequestOutput], Replica], Progress]


class RequestDriver:
    def __init__(self, prefill: list[Replica[PrefillReplicaAPI]], decode: list[Replica[DecodeReplicaAPI]],
                 settings: DriverSettings, *, block_size: int | None = None):
        """block_size: the replicas' KV block size in tokens (None: read from their info, else 16)."""
        self.pools = ReplicaPools(prefill, decode)
        self.settings = settings
        if block_size is None:
            block_size = next((r.info.block_size for r in prefill + decode if r.info is not None), 16)
        self.routing = Routing(settings.routing, block_size)
        self.feed = KVFeed(self.routing.indexes)
        self.pulls = PrefixPulls(block_size, settings.routing.pull_min_blocks, self.routing.indexes, self.pools)
        self.decode_room = DecodeRoom(settings.decode_room)  # requests waiting for decode room (step 1)
        self.aborts = Aborts()  # the aborts of requests that ended, some still going on
        self.waiting_room = PrefillWaitingRoom(settings.prefill_queue_tokens, settings.waiting_room)

    num_queued = property(lambda self: len(self.decode_room), doc="requests waiting for decode room (step 1)")

    @property
    def prefill(self) -> list[Replica[PrefillReplicaAPI]]:
        return self.pools.prefill

    @property
    def decode(self) -> list[Replica[DecodeReplicaAPI]]:
        return self.pools.decode

    lost = property(lambda self: self.pools.lost, doc="replicas found dead, no longer routed to")

    @property
    def num_waiting_prefill(self) -> int:
        """Requests waiting for a prefill replica's queue to shorten (late binding)."""
        return self.waiting_room.num_waiting

    @property
    def prefill_waiting_tokens(self) -> int:
        """Their uncached prompt tokens."""
        return self.waiting_room.waiting_tokens

    @property
    def num_fallbacks(self) -> int:
        """Requests whose transfer failed and that the decode replica prefilled instead."""
        return self.routing.decisions[("decode_replica", "transfer_failed")]

    @property
    def num_migrations(self) -> int:
        """Requests moved to another decode replica by token replay after theirs died (each move counted)."""
        return self.routing.decisions[("decode_replica", MIGRATION)]

    @property
    def num_prefill_retries(self) -> int:
        """Prompts prefilled again (another prefill replica, or the decode replica) after a prefill replica died."""
        return sum(self.routing.decisions[(where, PREFILL_DIED)] for where in ("prefill_pool", "decode_replica"))

    def replicas(self) -> list[Replica]:
        """Every replica routed to (what the KV feed polls)."""
        return self.pools.all()

    def remove(self, name: str) -> bool:
        """Stops routing to a replica (dead, or leaving its pool) and forgets what the index held for it.
        Returns whether it was in a pool."""
        replica = self.pools.remove(name)
        if replica is None:
            return False
        self.routing.forget_replica(replica.pool, name)
        self.feed.forget(name)
        self.waiting_room.wake(self.prefill)  # with the prefill pool empty, the decode replicas prefill
        return True

    def add(self, replica: Replica) -> None:
        """Starts routing to a ready replica. Raises ValueError for a name already routed to."""
        self.pools.add(replica)
        self.waiting_room.wake(self.prefill)

    def _prefill(self, load: ReplicaLoad) -> Replica[PrefillReplicaAPI]:
        return self.pools[load.name]

    def _decode(self, load: ReplicaLoad) -> Replica[DecodeReplicaAPI]:
        return self.pools[load.name]

    async def run(self, request: ParsedRequest, key: RunKey | None = None) -> AsyncIterator[Progress]:
        """Yields Progress until the request's last output, its outputs under request.request_id. key: how the
        replicas know the request (Serving passes one scoped by tenant and run; None: by request.request_id
        itself, for callers that made it unique: tests, benches, the mock cluster). Raises InvalidRequest-like
        ValueErrors from the replicas, NoCapacityError, NoReplicaError, ReplicaLostError (a replica died and the
        request could not move on: n > 1, max_migrations reached or no replica left; the message says which), or
        Ray's errors for a dead replica. A request with n == 1 and no seed is sent with one drawn here
        (migration.seeded), so that a replay after a replica's death draws as the first replica did."""
        if not self.decode:
            raise NoReplicaError("no ready replica in the decode pool")
        key = RunKey(request.tenant, request.request_id) if key is None else key
        request = dataclasses.replace(request, params=seeded(request.params))
        local = "colocated" if self.settings.mode == "colocated" else "n_gt_1" if request.params.n > 1 else None
        plan = self._plan(request, local)
        touched: list[tuple[Replica, str]] = []  # (replica, the request's id there)
        replay = Replay(key, self.settings.max_migrations)
        try:
            if plan.prefill is not None and self.settings.prefill_queue_tokens:
                plan = await self._wait_for_prefill_room(request, plan, local)
            if plan.prefill is None:
                replica = self._decode(next(plan.decode))
                self.routing.record(plan, prefill=None, decode=replica.name, session=request.session_id)
                async for progress in self._local(request, key, replica, plan.reason, touched, replay):
                    yield progress
                return
            async for progress in self._disaggregated(request, key, plan, touched, replay):
                yield progress
        finally:
            for replica, _ in touched:
                replica.load.in_flight -= 1
                self.feed.nudge(replica.name)
            await self.aborts.abort(key.replica_id(), touched)  # waits at most ABORT_WAIT_S (router/aborts.py)

    async def _wait_for_prefill_room(self, request: ParsedRequest, plan: RoutePlan, local: str | None) -> RoutePlan:
        """Late binding (step 0, with prefill_queue_tokens set): prefill_waiting_room.py's wait, planning the
        request again each time it is woken."""
        def replan() -> RoutePlan:
            if not self.decode:
                raise NoReplicaError("no ready replica in the decode pool")
            return self._plan(request, local)

        return await self.waiting_room.wait(plan, replan, queued=lambda: self.num_queued,
                                            max_queued=self.settings.max_queued_requests,
                                            timeout_s=self.settings.queue_timeout_s, tenant=request.tenant,
                                            priority=request.priority)

    def _plan(self, request: ParsedRequest, local: str | None = None) -> RoutePlan:
        prefill, decode = self.pools.loads(request.params.lora)  # those that serve its LoRA adapter, if any do
        return self.routing.plan(request.prompt_token_ids, prefill=prefill, decode=decode, local_reason=local,
                                 cache_salt=request.hash_salt, session=request.session_id)

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
            self.pools.lost.append(replica.name)
            _log.error("replica %s died; no longer routing to it: %s", replica.name, error)
        raise ReplicaLostError(f"replica {replica.name} died while serving the request") from None

    @staticmethod
    def _use(replica: Replica, request_id: str, touched: list[tuple[Replica, str]]) -> None:
        """Counts the request in flight on replica, where it runs as request_id (a RunKey.replica_id())."""
        replica.load.in_flight += 1
        touched.append((replica, request_id))

    async def _release(self, replica: Replica, request_id: str, touched: list[tuple[Replica, str]]) -> None:
        """Undoes _use before the request ends: aborts request_id on replica (it frees its blocks) and stops
        counting it there."""
        touched.remove((replica, request_id))
        replica.load.in_flight -= 1
        self.feed.nudge(replica.name)
        await asyncio.shield(abort_everywhere(request_id, [(replica, request_id)]))

    async def _reserve(self, request: ParsedRequest, key: RunKey, plan: RoutePlan,
                       touched: list[tuple[Replica, str]]
                       ) -> tuple[Replica[DecodeReplicaAPI], TransferDescriptor, float]:
        rid = key.replica_id()
        start = time.monotonic()
        place = None  # its place in the decode room, once no replica had room
        order = plan.decode
        try:
            while True:
                for load in order:
                    if (replica := self.pools.get(load.name)) is None:
                        continue  # it left the pool since the ranking
                    try:
                        descriptor = await self._call(replica, replica.api.reserve(
                            rid, request.prompt_token_ids, request.params, priority=request.priority,
                            cache_salt=request.cache_salt, tenant=request.tenant,  # senders: the prefill's agents
                            senders=info.kv_addresses if (info := self._prefill(plan.prefill).info) else (),
                            waited_s=time.monotonic() - start))
                    except ReplicaLostError as e:  # found dead before it held anything: try the next one
                        if not self.decode:
                            raise
                        _log.warning("request %s: %s; reserving on another decode replica", rid, e)
                        continue
                    if descriptor is not None:
                        replica.load.refusals = 0
                        self._use(replica, rid, touched)
                        return replica, descriptor, time.monotonic() - start
                    replica.load.refusals += 1
                if place is None:
                    if self.num_queued >= self.settings.max_queued_requests:
                        raise NoCapacityError(f"no decode replica has room for the prompt and "
                                              f"{self.num_queued} requests are already queued")
                    place = self.decode_room.join(tenant=request.tenant, priority=request.priority,
                                                  prompt_tokens=len(request.prompt_token_ids),
                                                  max_tokens=request.params.max_tokens)
                if time.monotonic() - start > self.settings.queue_timeout_s:
                    raise NoCapacityError(f"no decode replica had room for the prompt within "
                                          f"{self.settings.queue_timeout_s:g} s")
                await self.decode_room.next_try(place, RETRY_INTERVAL_S, start + self.settings.queue_timeout_s)
                if not self.decode:
                    raise NoReplicaError("no ready replica in the decode pool")
                order = self.routing.pickers["decode"].rank_decode([r.load for r in self.decode])
        finally:
            if place is not None:
                self.decode_room.leave(place)

    async def _disaggregated(self, request: ParsedRequest, key: RunKey, plan: RoutePlan,
                             touched: list[tuple[Replica, str]], replay: Replay) -> AsyncIterator[Progress]:
        """Steps 1-3. key: this attempt (a prefill retry has its own); replay: the client's delivery record. A
        failed transfer falls back to step L, a dead prefill replica to _prefill_again, a dead decode replica to
        step M (in _follow)."""
        rid = key.replica_id()
        prefill = self._prefill(plan.prefill)
        # Counted as queued there from the decision on: a burst spreads by load before any of it arrives.
        prefill.load.queued_prefill_tokens += plan.uncached_tokens
        self.waiting_room.wake(self.prefill)  # room left for the next one too?
        decode = None
        failure: Exception | None = None
        try:
            decode, descriptor, queue_s = await self._reserve(request, key, plan, touched)
            self.routing.record(plan, prefill=prefill.name, decode=decode.name, session=request.session_id)
            self._use(prefill, rid, touched)
            start = time.monotonic()
            await self.pulls.before_prefill(plan, prefill, f"{rid}/pull", request)
            result = await self._call(prefill, prefill.api.prefill(
                rid, request.prompt_token_ids, request.params, descriptor,
                priority=request.priority, cache_salt=request.cache_salt, tenant=request.tenant, trace=request.trace))
        except TransferFailedError as e:
            failure = e
        except ReplicaLostError as e:
            if decode is None:  # no decode replica was left to reserve on
                raise
            failure = e  # the prefill replica died
        finally:
            prefill.load.queued_prefill_tokens -= plan.uncached_tokens
            self.waiting_room.wake(self.prefill)
        if isinstance(failure, ReplicaLostError):
            async for progress in self._prefill_again(request, key, decode, failure, touched, replay):
                yield progress
            return
        if failure is None:
            answered = time.monotonic()

            def first(outputs: list[RequestOutput], at: Replica) -> Progress:
                now = time.monotonic()
                return Progress(outputs, prefill_replica=prefill.name, decode_replica=at.name,
                                prefill_route=PREFILL_POOL, num_cached_tokens=result.num_cached_tokens,
                                prefill_s=now - start, queue_s=queue_s, prefill_queue_s=result.queue_s,
                                transfer_s=result.transfer_s, admission_s=now - answered)

            stream = decode.api.decode(rid, result.first_token, trace=request.trace)
            try:
                async for progress in self._follow(request, decode, stream, first, touched, replay):
                    yield progress
                return
            except TransferFailedError as e:  # the decode replica saw the transfer fail (before any output)
                if replay.started:
                    raise
                failure = e
        # Nothing is held on either side now; the decode replica prefills the prompt itself.
        _log.warning("request %s: %s; prefilling on a decode replica instead", rid, failure)
        self.routing.count("decode_replica", "transfer_failed")
        async for progress in self._local(request, key.prefilled_locally(), decode, "transfer_failed", touched,
                                          replay):
            yield progress

    async def _prefill_again(self, request: ParsedRequest, key: RunKey, decode: Replica[DecodeReplicaAPI],
                             lost: ReplicaLostError, touched: list[tuple[Replica, str]],
                             replay: Replay) -> AsyncIterator[Progress]:
        """The prefill replica of attempt key died mid-prefill (lost): drops the decode reservation (nothing will
        arrive in it) and prefills the prompt again under a new attempt's key (Replay.next_key), on another
        prefill replica (a new plan) or, when the plan says so (none left, ...), on a decode replica (step L).
        Raises ReplicaLostError past max_migrations."""
        await self._release(decode, key.replica_id(), touched)
        if not replay.can_move:
            raise ReplicaLostError(f"{lost}; the request was moved {replay.moves} times already "
                                   f"(max_migrations={self.settings.max_migrations})") from None
        if not self.decode:
            raise NoReplicaError(f"{lost}, and no decode replica is left") from None
        retry = replay.next_key("p")
        plan = dataclasses.replace(self._plan(request), reason=PREFILL_DIED)  # recorded as a prefill after a death
        _log.warning("request %s: %s; prefilling it again on %s", replay.key.replica_id(), lost,
                     plan.prefill.name if plan.prefill else "a decode replica")
        if plan.prefill is not None:
            async for progress in self._disaggregated(request, retry, plan, touched, replay):
                yield progress
            return
        replica = self._decode(next(plan.decode))
        self.routing.record(plan, prefill=None, decode=replica.name, session=request.session_id)
        async for progress in self._local(request, retry, replica, PREFILL_DIED, touched, replay):
            yield progress

    async def _local(self, request: ParsedRequest, key: RunKey, replica: Replica[DecodeReplicaAPI], reason: str,
                     touched: list[tuple[Replica, str]], replay: Replay) -> AsyncIterator[Progress]:
        """Step L: the decode replica prefills and decodes attempt key (after a failed transfer, a key of its own:
        RunKey.prefilled_locally)."""
        rid = key.replica_id()
        start = time.monotonic()
        self._use(replica, rid, touched)
        stream = replica.api.generate(rid, request.prompt_token_ids, request.params, priority=request.priority,
                                      cache_salt=request.cache_salt, tenant=request.tenant, trace=request.trace)

        def first(outputs: list[RequestOutput], at: Replica) -> Progress:
            return Progress(outputs, decode_replica=at.name, prefill_route=reason, prefill_s=time.monotonic() - start)

        async for progress in self._follow(request, replica, stream, first, touched, replay):
            yield progress

    async def _follow(self, request: ParsedRequest, replica: Replica[DecodeReplicaAPI],
                      stream: AsyncIterator[list[RequestOutput]], first: FirstProgress,
                      touched: list[tuple[Replica, str]], replay: Replay) -> AsyncIterator[Progress]:
        """Forwards a decode stream's outputs as progress, the first the request forwards built by first(outputs,
        the replica streaming), the rest plain (so usage and timings are not reset). When the streaming replica
        dies, the request continues on another decode replica (step M, _migrate) and its outputs are forwarded
        the same way. Raises ReplicaLostError when the request cannot move."""
        while True:
            try:
                async for outputs in self._items(replica, stream):
                    outputs = replay.forward(outputs)
                    progress = Progress(outputs) if replay.started else first(outputs, replica)
                    replay.started = True
                    yield progress
                return
            except ReplicaLostError as lost:
                replica, stream = self._migrate(request, lost, touched, replay)

    def _migrate(self, request: ParsedRequest, lost: ReplicaLostError, touched: list[tuple[Replica, str]],
                 replay: Replay) -> tuple[Replica[DecodeReplicaAPI], AsyncIterator[list[RequestOutput]]]:
        """Step M (migration.py): the decode replica streaming the request died (lost). Picks the best decode
        replica left (the routing's decode ranking) and opens the replay there, under a new attempt's key
        (Replay.next_key). Raises ReplicaLostError (UNAVAILABLE) for n > 1 (never migrated), past max_migrations,
        or with no decode replica left."""
        if request.params.n > 1:
            raise ReplicaLostError(f"{lost} (a request with n > 1 is not migrated)") from None
        if not replay.can_move:
            raise ReplicaLostError(f"{lost}; the request was moved {replay.moves} times already "
                                   f"(max_migrations={self.settings.max_migrations})") from None
        if not self.decode:
            raise ReplicaLostError(f"{lost}, and no other decode replica is left to continue it") from None
        replica = self._decode(next(self.routing.pickers["decode"].rank_decode([r.load for r in self.decode])))
        rid = replay.next_key("m").replica_id()
        self.routing.count("decode_replica", MIGRATION)
        _log.warning("request %s: %s; continuing it on %s after %d delivered tokens (as %s)",
                     replay.key.replica_id(), lost, replica.name, len(replay.token_ids), rid)
        self._use(replica, rid, touched)
        return replica, replica.api.resume(rid, request.prompt_token_ids, request.params,
                                           replay.resume_state(request.params.seed), priority=request.priority,
                                           cache_salt=request.cache_salt, tenant=request.tenant, trace=request.trace)
