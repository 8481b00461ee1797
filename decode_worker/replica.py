"""One decode replica (PP stages x EP ranks x TP ranks): the Ray actor class the control plane starts in its
placement group. It serves three kinds of request:

  - transferred (disaggregated): reserve() holds blocks for a prompt and returns the transfer descriptor the
    prefill replica pushes into; decode() waits for the KV to arrive, continues the request from the prefill
    replica's first token and streams the rest;
  - local (colocated mode, n > 1, or the router's fallback after a failed transfer): generate() prefills and
    decodes here;
  - abort() ends a request in any of these phases, freeing its blocks.

Streams yield lists of RequestOutput: everything produced since the consumer's last read, so one message per
engine step at most crosses to the router, however many tokens it carries.
"""

from __future__ import annotations

from typing import AsyncIterator, Sequence

from tandem.engine.output_processor import RequestOutput
from tandem.engine.kv_events import KVEventLog
from tandem.engine.replica_server import ReplicaServer, node_address
from tandem.engine.replica_spec import ReplicaSpec
from tandem.engine.sampler import SampledToken
from tandem.engine.sampling_params import SamplingParams
from tandem.kv_transfer.agent_factory import AgentFactory
from tandem.kv_transfer.config import TransferConfig
from tandem.kv_transfer.connector import DecodeConnector
from tandem.kv_transfer.connector_loop import ConnectorLoop, TransferFailedError
from tandem.kv_transfer.descriptor import TransferDescriptor, TransferState


class DecodeReplica:
    def __init__(self, name: str, spec: ReplicaSpec, transfer: TransferConfig | None):
        """transfer None: a colocated replica (no KV agents; reserve/decode are refused). transfer.host "": this
        node's address."""
        if transfer is not None and not transfer.host:
            transfer = transfer.on_host(node_address())
        events = KVEventLog()
        engine = spec.build(kv_agent=AgentFactory(transfer) if transfer is not None else None, event_sink=events)
        self.connector = DecodeConnector(engine, transfer) if transfer is not None else None
        self.transfers = ConnectorLoop(self.connector) if self.connector is not None else None
        self.replica = ReplicaServer(name, "decode", engine, tick=self.transfers.tick if self.transfers else None,
                                     events=events)
        self.server = self.replica.server

    async def ready(self) -> dict:
        info = self.replica.info()
        info["kv_addresses"] = list(self.connector.addresses) if self.connector else []
        return info

    async def stats(self) -> dict:
        return await self.replica.stats()

    async def kv_events(self, epoch: str | None, since: int) -> dict:
        return await self.replica.kv_events(epoch, since)

    async def reserve(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, *,
                      priority: int = 0, cache_salt: str | None = None) -> TransferDescriptor | None:
        """Holds blocks for the prompt's KV (cache_salt: the tenant's prefix-cache salt); None when there is no
        room now. Raises ValueError / RequestRejectedError for a request this replica cannot serve."""
        if self.connector is None:
            raise ValueError(f"decode replica {self.replica.name} is colocated: it takes no KV transfers")
        self.replica.check_not_aborted(request_id)
        return await self.server.call(
            lambda _e: self.connector.reserve(request_id, prompt_token_ids, params, priority=priority,
                                              cache_salt=cache_salt))

    async def decode(self, request_id: str, first_token: SampledToken) -> AsyncIterator[list[RequestOutput]]:
        """Waits for the reserved request's KV, admits it with first_token and streams its outputs (the first
        one carries first_token). Raises TransferFailedError if the transfer ended badly (blocks are free)."""
        self.replica.check_not_aborted(request_id)
        stream = self.server.open_stream(request_id)
        try:
            event = await self.transfers.wait(self.server, request_id)
            if event.state is not TransferState.DONE:
                raise TransferFailedError(request_id, event.state, event.error)

            def admit(_engine) -> None:
                for output in self.connector.admit(request_id, first_token):
                    self.server.deliver(request_id, output, final=output.finished)

            await self.server.call(admit)
        except BaseException:
            self.server.close_stream(request_id)
            await self.abort(request_id)
            raise
        async for batch in self.server.batches(request_id, stream):
            yield batch

    async def generate(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, *,
                       priority: int = 0, cache_salt: str | None = None) -> AsyncIterator[list[RequestOutput]]:
        """Prefills and decodes the request here; streams its outputs."""
        self.replica.check_not_aborted(request_id)
        stream = self.server.add_request(request_id, prompt_token_ids, params, priority=priority,
                                         cache_salt=cache_salt)
        async for batch in self.server.batches(request_id, stream):
            yield batch

    async def abort(self, request_id: str) -> None:
        """Ends the request wherever it is here (reserved, receiving, decoding) and frees its blocks; a later
        reserve/decode/generate call for the same id is refused. Unknown ids are remembered, not an error."""
        self.replica.mark_aborted(request_id)
        if self.transfers is not None:
            await self.server.call(lambda _e: self.transfers.forget(request_id))
        await self.server.abort(request_id)

    async def check_integrity(self) -> None:
        await self.replica.check_integrity()

    async def shutdown(self) -> None:
        await self.replica.shutdown()
