"""A replica's Ray actor handle behind the contract's Protocols (replica/contract.py): each method makes the one
Ray call of the same name and awaits it, and a streaming method sends its call as a typed message
(replica/contract.py StreamCall: DecodeCall, GenerateCall, ResumeCall) and yields each item as it arrives: over
the replica's token channel (replica/token_channel.py: one TCP connection per router and replica, the Ray call
stream_on_channel beside it) or, where the channel cannot be opened or token_channel=False, as a Ray streaming
call of the replica's `stream`. The router and the control plane hold these, so a call reads
`await replica.api.reserve(...)` and a reader can jump from it to the Protocol and from there to the actor's
method. Picklable (a Ray handle is; the channel is
not pickled, each process opens its own): the control plane passes them to the router actor.

Errors come back as Ray raises them: the replica's own exception (ValueError, TransferFailedError, ...) as is,
or a RayActorError subclass when the actor is gone (see router/lifecycle.py's is_replica_death).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator, Sequence

from tandem.engine.core.output_processor import RequestOutput
from tandem.engine.core.resume import ResumeState
from tandem.engine.sampled_token import SampledToken
from tandem.engine.sampling_params import SamplingParams
from tandem.kv_transfer.descriptor import TransferDescriptor
from tandem.replica.contract import (DecodeCall, GenerateCall, KVEventsReply, PrefillResult, ReplicaInfo,
                                     ReplicaStats, ResumeCall, StreamCall)
from tandem.replica.token_channel import CLOSED, ChannelClient, ChannelEnd, ChannelError, open_channel

_log = logging.getLogger(__name__)
_CALL_DONE = object()  # queued to a channel stream's queue when its Ray call has answered


async def _stream(generator) -> AsyncIterator[Any]:
    """The items of a Ray streaming call (an ObjectRefGenerator), awaited one by one."""
    async for ref in generator:
        yield await ref


async def _channel_stream(actor: Any, client: ChannelClient, call: StreamCall) -> AsyncIterator[Any]:
    """The batches of the replica's stream `call` over its token channel (token_channel.py, step 2): yields
    frames as they arrive until the Ray call has answered and every frame it counted has; then raises the
    stream's exception, if any. The replica's death raises the Ray call's error after the frames that arrived.
    Leaving early cancels the Ray call."""
    import ray

    key, queue = client.open()
    ref = actor.stream_on_channel.remote(client.connection, key, call)
    pending = asyncio.ensure_future(ref)

    def answered(done: asyncio.Future) -> None:
        if not done.cancelled():
            done.exception()  # retrieved: the consumer raises it, or has left
        queue.put_nowait(_CALL_DONE)

    pending.add_done_callback(answered)
    received, end, closed = 0, None, False
    try:
        while end is None or received < end.sent:
            item = await queue.get()
            if item is _CALL_DONE:
                try:
                    end = pending.result()
                except Exception:  # the replica died (or the call failed): what arrived, then the error
                    while not queue.empty():
                        item = queue.get_nowait()
                        if item is not CLOSED:
                            yield item
                    raise
                if not isinstance(end, ChannelEnd):
                    raise TypeError(f"stream_on_channel answered a {type(end).__name__}")
                if closed and received < end.sent:
                    raise ChannelError(f"the token channel closed with {end.sent - received} batches not delivered")
            elif item is CLOSED:
                closed = True
                if end is not None:
                    raise ChannelError(f"the token channel closed with {end.sent - received} batches not delivered")
            else:
                received += 1
                yield item
        if end.error is not None:
            raise end.error
    finally:
        client.release(key)
        if not pending.done():
            try:
                ray.cancel(ref)
            except Exception as e:  # the replica ends the stream anyway when the router aborts the request
                _log.debug("cancelling a %s stream: %r", type(call).__name__, e)


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

    async def reserve_prefix(self, pull_id: str, prefix_token_ids: Sequence[int], *, cache_salt: str | None = None,
                             senders: tuple[str, ...] = ()) -> TransferDescriptor | None:
        return await self.actor.reserve_prefix.remote(pull_id, prefix_token_ids, cache_salt=cache_salt,
                                                      senders=senders)

    async def send_prefix(self, pull_id: str, block_hashes: tuple[int, ...], descriptor: TransferDescriptor, *,
                          prefix_token_ids: tuple[int, ...] = (), cache_salt: str | None = None) -> None:
        await self.actor.send_prefix.remote(pull_id, block_hashes, descriptor, prefix_token_ids=prefix_token_ids,
                                            cache_salt=cache_salt)

    async def keep_prefix(self, pull_id: str) -> int:
        return await self.actor.keep_prefix.remote(pull_id)

    async def load_lora(self, name: str, path: str) -> float:
        return await self.actor.load_lora.remote(name, path)

    async def unload_lora(self, name: str) -> None:
        await self.actor.unload_lora.remote(name)

    async def shutdown(self) -> None:
        await self.actor.shutdown.remote()


class RemotePrefillReplica(RemoteReplica):
    """PrefillReplicaAPI over a PrefillReplica actor."""

    async def prefill(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                      descriptor: TransferDescriptor, *, priority: int = 0, cache_salt: str | None = None,
                      tenant: str | None = None, trace: str | None = None) -> PrefillResult:
        return await self.actor.prefill.remote(request_id, prompt_token_ids, params, descriptor, priority=priority,
                                               cache_salt=cache_salt, tenant=tenant, trace=trace)


class RemoteDecodeReplica(RemoteReplica):
    """DecodeReplicaAPI over a DecodeReplica actor. token_channel: stream over the replica's token channel
    (False: Ray streaming calls only)."""

    def __init__(self, actor: Any, token_channel: bool = True):
        super().__init__(actor)
        self.token_channel = token_channel
        self._client: ChannelClient | None = None
        self._connecting: asyncio.Future | None = None

    def __getstate__(self) -> dict:
        return {"actor": self.actor, "token_channel": self.token_channel}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["actor"], state["token_channel"])

    async def _channel(self) -> ChannelClient | None:
        """This process's open connection to the replica's token channel, opened on first use and again after it
        closed; None when it cannot be opened (then streams go over Ray, and a warning says why)."""
        if not self.token_channel:
            return None
        loop = asyncio.get_running_loop()
        if self._client is not None and not self._client.closed and self._client.loop is loop:
            return self._client
        if self._connecting is None or self._connecting.get_loop() is not loop:
            self._connecting = asyncio.ensure_future(self._open())
        try:
            return await asyncio.shield(self._connecting)
        finally:
            if self._connecting is not None and self._connecting.done():
                self._connecting = None

    async def _open(self) -> ChannelClient | None:
        try:
            self._client = await open_channel(await self.actor.channel_endpoint.remote())
        except (OSError, asyncio.TimeoutError, ChannelError) as e:
            _log.warning("token channel to %s could not be opened (%r); streaming over Ray calls", self.actor, e)
            self._client, self.token_channel = None, False
        return self._client

    async def _streamed(self, call: StreamCall) -> AsyncIterator[list[RequestOutput]]:
        client = await self._channel()
        if client is None:
            stream = _stream(self.actor.stream.options(num_returns="streaming").remote(call))
        else:
            stream = _channel_stream(self.actor, client, call)
        async for batch in stream:
            yield batch

    async def reserve(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, *,
                      priority: int = 0, cache_salt: str | None = None, senders: tuple[str, ...] = (),
                      tenant: str | None = None, waited_s: float = 0.0) -> TransferDescriptor | None:
        return await self.actor.reserve.remote(request_id, prompt_token_ids, params, priority=priority,
                                               cache_salt=cache_salt, senders=senders, tenant=tenant,
                                               waited_s=waited_s)

    def decode(self, request_id: str, first_token: SampledToken, *,
               trace: str | None = None) -> AsyncIterator[list[RequestOutput]]:
        return self._streamed(DecodeCall(request_id, first_token, trace))

    def generate(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, *,
                 priority: int = 0, cache_salt: str | None = None, tenant: str | None = None,
                 trace: str | None = None) -> AsyncIterator[list[RequestOutput]]:
        return self._streamed(GenerateCall(request_id, prompt_token_ids, params, priority, cache_salt, trace, tenant))

    def resume(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
               resume: ResumeState, *, priority: int = 0, cache_salt: str | None = None,
               tenant: str | None = None, trace: str | None = None) -> AsyncIterator[list[RequestOutput]]:
        return self._streamed(ResumeCall(request_id, prompt_token_ids, params, resume, priority, cache_salt, trace,
                                         tenant))


def remote_replica(pool: str, actor: Any, *, token_channel: bool = True) -> RemotePrefillReplica | RemoteDecodeReplica:
    """The typed view of a replica actor of `pool` ("prefill" | "decode"); token_channel: as RemoteDecodeReplica
    takes it (manifest router.token_channel)."""
    if pool == "prefill":
        return RemotePrefillReplica(actor)
    if pool == "decode":
        return RemoteDecodeReplica(actor, token_channel)
    raise ValueError(f"unknown pool {pool!r} (expected prefill or decode)")
