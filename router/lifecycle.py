"""One request through the cluster, as the router drives it (DESIGN.md section 2). Disaggregated, n == 1:

  1. Reserve. Decode replicas are asked in the policy's order until one holds blocks for the prompt and returns
     a transfer descriptor. When none has room the request waits (polling) up to queue_timeout_s, and at most
     max_queued_requests requests wait at once; past either, RESOURCE_EXHAUSTED.
  2. Prefill. A prefill replica (policy order) computes the prompt, reusing its prefix cache, and pushes the
     KV of each layer into the descriptor as soon as it is written; it answers with the first token once every
     decode rank has acknowledged its data.
  3. Decode. The decode replica admits the request with that first token and streams its outputs back; each
     engine step's outputs travel decode replica -> router as one Ray message, then to the client.
  4. End. A stop, a length limit or an error ends the stream; a client that goes away or an Abort cancels the
     driving task, and every replica the request touched is told to abort it (each frees its blocks).

  Failure: a transfer that fails, expires or is aborted leaves nothing held on either side (the connectors
  clean up); the router then lets a decode replica prefill the prompt itself (step L below). A replica that
  dies surfaces as UNAVAILABLE.

Colocated mode, n > 1 and that fallback take the local path (L): one decode replica's generate() prefills and
decodes, streaming the same way.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from tandem.engine.output_processor import RequestOutput
from tandem.kv_transfer.connector_loop import TransferFailedError
from tandem.router.policy import ReplicaLoad, ReplicaPicker
from tandem.router.request_parsing import ParsedRequest

_log = logging.getLogger(__name__)
RETRY_INTERVAL_S = 0.02


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
    except ImportError:  # the driver also runs over mock handles without Ray
        return False
    return isinstance(error, RayActorError)


@dataclass
class Replica:
    """A replica as the router sees it: its Ray actor handle, static info, and the router's load counters."""

    name: str
    pool: str
    handle: Any
    info: dict = field(default_factory=dict)
    load: ReplicaLoad = None

    def __post_init__(self) -> None:
        self.load = self.load or ReplicaLoad(self.name)


@dataclass(frozen=True)
class DriverSettings:
    mode: str = "disaggregated"
    policy: str = "least_loaded"
    max_queued_requests: int = 256
    queue_timeout_s: float = 30.0


@dataclass
class Progress:
    """What the driver reports as the request moves: outputs to forward, and facts for usage and timings."""

    outputs: list[RequestOutput]
    prefill_replica: str = ""
    decode_replica: str = ""
    num_cached_tokens: int | None = None  # the prefill replica's cache hits (disaggregated)
    prefill_s: float = 0.0
    queue_s: float = 0.0


class RequestDriver:
    def __init__(self, prefill: list[Replica], decode: list[Replica], settings: DriverSettings):
        self.prefill = prefill
        self.decode = decode
        self.settings = settings
        # One picker per pool: a shared round-robin turn would advance twice per request and never rotate.
        self.pickers = {"prefill": ReplicaPicker(settings.policy), "decode": ReplicaPicker(settings.policy)}
        self.num_queued = 0
        self.num_fallbacks = 0
        self.lost: list[str] = []  # replicas found dead, no longer routed to

    def _ordered(self, pool: list[Replica]) -> list[Replica]:
        if not pool:
            raise NoReplicaError("no ready replica in the pool")
        by_name = {r.name: r for r in pool}
        return [by_name[load.name] for load in self.pickers[pool[0].pool].order([r.load for r in pool])]

    async def run(self, request: ParsedRequest) -> AsyncIterator[Progress]:
        """Yields Progress until the request's last output. Raises InvalidRequest-like ValueErrors from the
        replicas, NoCapacityError, NoReplicaError, or Ray's errors for a dead replica."""
        touched: list[tuple[Replica, str]] = []  # (replica, the request's id there)
        try:
            if self.settings.mode == "colocated" or request.params.n > 1:
                async for progress in self._local(request, touched):
                    yield progress
                return
            async for progress in self._disaggregated(request, touched):
                yield progress
        finally:
            for replica, _ in touched:
                replica.load.in_flight -= 1
            await asyncio.shield(self._abort_everywhere(request.request_id, touched))

    async def _call(self, replica: Replica, ref):
        """Awaits a call on replica; if the replica died, stops routing to it and raises ReplicaLostError."""
        try:
            return await ref
        except Exception as e:
            self._check_death(replica, e)
            raise

    async def _items(self, replica: Replica, stream) -> AsyncIterator[list[RequestOutput]]:
        """The items of a streaming call on replica, with the replica's death handled as in _call."""
        while True:
            try:
                ref = await stream.__anext__()
            except StopAsyncIteration:
                return
            except Exception as e:
                self._check_death(replica, e)
                raise
            yield await self._call(replica, ref)

    def _check_death(self, replica: Replica, error: Exception) -> None:
        if not is_replica_death(error):
            return
        pool = self.prefill if replica.pool == "prefill" else self.decode
        if replica in pool:
            pool.remove(replica)
            self.lost.append(replica.name)
            _log.error("replica %s died; no longer routing to it: %s", replica.name, error)
        raise ReplicaLostError(f"replica {replica.name} died while serving the request") from None

    async def _abort_everywhere(self, request_id: str, touched: list[tuple[Replica, str]]) -> None:
        """Tells every replica the request touched to drop it (a no-op where it finished)."""
        calls = [(replica, replica.handle.abort.remote(rid)) for replica, rid in touched]
        for replica, call in calls:
            try:
                await call
            except Exception as e:  # a dead replica holds nothing any more
                _log.warning("abort of %s on %s failed: %r", request_id, replica.name, e)

    @staticmethod
    def _use(replica: Replica, request_id: str, touched: list[tuple[Replica, str]]) -> None:
        replica.load.in_flight += 1
        touched.append((replica, request_id))

    async def _reserve(self, request: ParsedRequest, touched: list[Replica]) -> tuple[Replica, Any, float]:
        start = time.monotonic()
        queued = False
        try:
            while True:
                for replica in self._ordered(self.decode):
                    descriptor = await self._call(replica, replica.handle.reserve.remote(
                        request.request_id, request.prompt_token_ids, request.params, priority=request.priority))
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
        finally:
            if queued:
                self.num_queued -= 1

    async def _disaggregated(self, request: ParsedRequest, touched: list[Replica]) -> AsyncIterator[Progress]:
        decode, descriptor, queue_s = await self._reserve(request, touched)
        prefill = self._ordered(self.prefill)[0]
        self._use(prefill, request.request_id, touched)
        start = time.monotonic()
        try:
            result = await self._call(prefill, prefill.handle.prefill.remote(
                request.request_id, request.prompt_token_ids, request.params, descriptor, priority=request.priority))
            stream = decode.handle.decode.options(num_returns="streaming").remote(request.request_id,
                                                                                   result.first_token)
            first = True
            async for outputs in self._items(decode, stream):
                if first:
                    yield Progress(outputs, prefill_replica=prefill.name, decode_replica=decode.name,
                                   num_cached_tokens=result.num_cached_tokens, prefill_s=time.monotonic() - start,
                                   queue_s=queue_s)
                    first = False
                else:
                    yield Progress(outputs)
        except TransferFailedError as e:
            # Nothing is held on either side now; the decode replicas prefill the prompt themselves.
            _log.warning("request %s: %s; prefilling on a decode replica instead", request.request_id, e)
            self.num_fallbacks += 1
            async for progress in self._local(request, touched, retry_of=decode):
                yield progress

    async def _local(self, request: ParsedRequest, touched: list[tuple[Replica, str]], *,
                     retry_of: Replica | None = None) -> AsyncIterator[Progress]:
        # A retry runs under its own id on the replica: the failed reservation's id may still be winding down.
        local_id = request.request_id if retry_of is None else f"{request.request_id}.local"
        start = time.monotonic()
        replica = self._ordered(self.decode)[0]
        self._use(replica, local_id, touched)
        stream = replica.handle.generate.options(num_returns="streaming").remote(
            local_id, request.prompt_token_ids, request.params, priority=request.priority)
        first = True
        async for outputs in self._items(replica, stream):
            if retry_of is not None:
                outputs = [dataclasses.replace(o, request_id=request.request_id) for o in outputs]
            if first:
                yield Progress(outputs, decode_replica=replica.name, prefill_s=time.monotonic() - start)
            else:
                yield Progress(outputs)
            first = False
