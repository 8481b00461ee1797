"""A replica's Ray actor handle behind the contract's Protocols (replica/contract.py): each method makes the one
Ray call of the same name and awaits it, and a streaming method yields each item as Ray delivers it. The router
and the control plane hold these, so a call reads `await replica.api.reserve(...)` and a reader can jump from it
to the Protocol and from there to the actor's method. Picklable (a Ray handle is): the control plane passes them
to the router actor.

Errors come back as Ray raises them: the replica's own exception (ValueError, TransferFailedError, ...) as is,
or a RayActorError subclass when the actor is gone (see router/lifecycle.py's is_replica_death).
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Sequence

from tandem.engine.output_processor import RequestOutput
from tandem.engine.resume import ResumeState
from tandem.engine.sampled_token import SampledToken
from tandem.engine.sampling_params import SamplingParams
from tandem.kv_transfer.descriptor import TransferDescriptor
from tandem.replica.contract import KVEventsReply, PrefillResult, ReplicaInfo, ReplicaStats


async def _stream(generator) -> AsyncIterator[Any]:
    """The items of a Ray streaming call (an ObjectRefGenerator), awaited one by one."""
    async for ref in generator:
        yield await ref


class RemoteReplica:
    """ReplicaAPI over a Ray actor handle (`actor`: what ray.remote(...).remote() returned)."""

    def __init__(self, actor: Any):
        self.actor = actor

    async def ready(self) -> ReplicaInfo:
        return await self.actor.ready.remote()

    async def stats(self) -> ReplicaStats:
        return await self.actor.stats.remote()

    async def health(self) -> str | None:
        return await self.actor.health.remote()

    async def kv_events(self, epoch: str | None, since: int) -> KVEventsReply:
        return await self.actor.kv_events.remote(epoch, since)

    async def abort(self, request_id: str) -> None:
        await self.actor.abort.remote(request_id)

    async def check_integrity(self) -> None:
        await self.actor.check_integrity.remote()

    async def shutdown(self) -> None:
        await self.actor.shutdown.remote()


class RemotePrefillReplica(RemoteReplica):
    """PrefillReplicaAPI over a PrefillReplica actor."""

    async def prefill(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                      descriptor: TransferDescriptor, *, priority: int = 0,
                      cache_salt: str | None = None) -> PrefillResult:
        return await self.actor.prefill.remote(request_id, prompt_token_ids, params, descriptor, priority=priority,
                                               cache_salt=cache_salt)


class RemoteDecodeReplica(RemoteReplica):
    """DecodeReplicaAPI over a DecodeReplica actor."""

    async def reserve(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, *,
                      priority: int = 0, cache_salt: str | None = None,
                      senders: tuple[str, ...] = ()) -> TransferDescriptor | None:
        return await self.actor.reserve.remote(request_id, prompt_token_ids, params, priority=priority,
                                               cache_salt=cache_salt, senders=senders)

    def decode(self, request_id: str, first_token: SampledToken) -> AsyncIterator[list[RequestOutput]]:
        return _stream(self.actor.decode.options(num_returns="streaming").remote(request_id, first_token))

    def generate(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, *,
                 priority: int = 0, cache_salt: str | None = None) -> AsyncIterator[list[RequestOutput]]:
        return _stream(self.actor.generate.options(num_returns="streaming").remote(
            request_id, prompt_token_ids, params, priority=priority, cache_salt=cache_salt))


    def resume(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
               resume: ResumeState, *, priority: int = 0,
               cache_salt: str | None = None) -> AsyncIterator[list[RequestOutput]]:
        return _stream(self.actor.resume.options(num_returns="streaming").remote(
            request_id, prompt_token_ids, params, resume, priority=priority, cache_salt=cache_salt))


def remote_replica(pool: str, actor: Any) -> RemotePrefillReplica | RemoteDecodeReplica:
    """The typed view of a replica actor of `pool` ("prefill" | "decode")."""
    if pool == "prefill":
        return RemotePrefillReplica(actor)
    if pool == "decode":
        return RemoteDecodeReplica(actor)
    raise ValueError(f"unknown pool {pool!r} (expected prefill or decode)")
