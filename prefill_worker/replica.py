"""One prefill replica (TP ranks, optionally PP): the Ray actor class the control plane starts in its placement
group. prefill() computes a prompt (reusing this replica's own prefix cache), pushes its KV layer by layer into
the decode replica's reservation (the descriptor), and returns the first token once every destination rank has
acknowledged the data. abort() ends a request in any phase.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from tandem.engine.kv_events import KVEventLog
from tandem.engine.replica_server import ReplicaServer, node_address
from tandem.engine.replica_spec import ReplicaSpec
from tandem.engine.sampler import SampledToken
from tandem.engine.sampling_params import SamplingParams
from tandem.kv_transfer.agent_factory import AgentFactory
from tandem.kv_transfer.config import TransferConfig
from tandem.kv_transfer.connector import PrefillConnector, TransferEvent, first_token_of
from tandem.kv_transfer.connector_loop import ConnectorLoop, TransferFailedError
from tandem.kv_transfer.descriptor import TransferDescriptor, TransferState


@dataclass(frozen=True)
class PrefillResult:
    """The prompt's first token (for DecodeReplica.decode) and how many prompt tokens came from the cache."""

    first_token: SampledToken
    num_prompt_tokens: int
    num_cached_tokens: int


class PrefillReplica:
    def __init__(self, name: str, spec: ReplicaSpec, transfer: TransferConfig):
        """transfer.host "": this node's address."""
        if not transfer.host:
            transfer = transfer.on_host(node_address())
        events = KVEventLog()
        engine = spec.build(kv_agent=AgentFactory(transfer), event_sink=events)
        self.connector = PrefillConnector(engine)
        self.transfers = ConnectorLoop(self.connector, on_failed=self._end_stream)
        self.replica = ReplicaServer(name, "prefill", engine, tick=self.transfers.tick, events=events)
        self.server = self.replica.server

    def _end_stream(self, event: TransferEvent) -> None:
        """Engine thread: the connector already aborted the request in the engine; wake its prefill() call."""
        self.server.deliver(event.request_id, TransferFailedError(event.request_id, event.state, event.error),
                            final=True)

    async def ready(self) -> dict:
        return self.replica.info()

    async def stats(self) -> dict:
        return await self.replica.stats()

    async def kv_events(self, epoch: str | None, since: int) -> dict:
        return await self.replica.kv_events(epoch, since)

    async def prefill(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                      descriptor: TransferDescriptor, *, priority: int = 0,
                      cache_salt: str | None = None) -> PrefillResult:
        """cache_salt: the tenant's prefix-cache salt (None: none). Raises ValueError for a request this replica
        cannot serve, TransferFailedError if the KV did not reach the decode replica (nothing is held here then)."""
        self.replica.check_not_aborted(request_id)
        stream = self.server.open_stream(request_id)
        try:
            await self.server.call(lambda _e: self.connector.submit(request_id, prompt_token_ids, params, descriptor,
                                                                    priority=priority, cache_salt=cache_salt))
        except BaseException:
            self.server.close_stream(request_id)
            raise
        first = None
        try:
            async for output in self.server.stream(request_id, stream):
                if output.token_ids:
                    first = output
        except TransferFailedError:  # ended by the connector (see _end_stream): its outcome is this error
            await self.server.call(lambda _e: self.transfers.forget(request_id))
            raise
        if first is None:
            raise TransferFailedError(request_id, TransferState.ABORTED, "the prefill was aborted")
        event = await self.transfers.wait(self.server, request_id)
        if event.state is not TransferState.DONE:
            raise TransferFailedError(request_id, event.state, event.error)
        return PrefillResult(first_token_of(first), first.num_prompt_tokens, first.num_cached_tokens)

    async def abort(self, request_id: str) -> None:
        self.replica.mark_aborted(request_id)
        await self.server.call(lambda _e: self.transfers.forget(request_id))
        await self.server.abort(request_id)

    async def check_integrity(self) -> None:
        await self.replica.check_integrity()

    async def shutdown(self) -> None:
        await self.replica.shutdown()
