"""One prefill replica (TP ranks, optionally PP): the Ray actor class the control plane starts in its placement
group. prefill() computes a prompt (reusing this replica's own prefix cache), pushes its KV layer by layer into
the decode replica's reservation (the descriptor), and returns the first token once every destination rank has
acknowledged the data. What every replica answers (ready, stats, kv_events, abort, ...) is the shell's
(replica/shell.py); the contract is replica/contract.py's PrefillReplicaAPI.
"""

from __future__ import annotations

import time

from typing import TYPE_CHECKING, Sequence

from tandem.engine.sampling_params import SamplingParams
from tandem.kv_transfer.config import TransferConfig
from tandem.kv_transfer.descriptor import TransferDescriptor, TransferFailedError, TransferState
from tandem.replica.contract import PrefillResult
from tandem.replica.shell import ReplicaShell
from tandem.replica.spec import ReplicaSpec
from tandem.replica.tracing import CallTrace, TracingConfig, Untraced, status_of

if TYPE_CHECKING:  # the runtime is imported when the replica is built (replica/shell.py says why)
    from tandem.kv_transfer.connector import PrefillConnector, TransferEvent


class PrefillReplica(ReplicaShell):
    pool = "prefill"
    connector: PrefillConnector

    def __init__(self, name: str, spec: ReplicaSpec, transfer: TransferConfig, *, settle_heap: bool = False,
                 tracing: TracingConfig | None = None):
        """transfer.host "": this node's address. settle_heap, tracing: ReplicaShell's."""
        if transfer is None:
            raise ValueError(f"prefill replica {name} needs a transfer config: it only serves disaggregated prompts")
        from tandem.kv_transfer.connector import PrefillConnector

        super().__init__(name, spec, transfer, lambda engine, _transfer: PrefillConnector(engine),
                         settle_heap=settle_heap, tracing=tracing)

    def _transfer_failed(self, event: TransferEvent) -> None:
        """Engine thread: the connector already aborted the request in the engine; wake its prefill() call."""
        self.server.deliver(event.request_id, TransferFailedError(event.request_id, event.state, event.error),
                            final=True)

    async def prefill(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                      descriptor: TransferDescriptor, *, priority: int = 0, cache_salt: str | None = None,
                      tenant: str | None = None, trace: str | None = None) -> PrefillResult:
        """cache_salt: the tenant's prefix-cache salt (None: none); tenant: who sent it. trace: the router's
        traceparent (a span prefill_replica with phases queue, compute and kv_send: replica/tracing.py). Raises
        ValueError for a request this replica cannot serve, TransferFailedError if the KV did not reach the decode
        replica (nothing is held here then)."""
        call = self._trace(trace, "prefill_replica", request_id)
        status = "OK"
        try:
            return await self._prefill(request_id, prompt_token_ids, params, descriptor, priority, cache_salt, tenant,
                                       call)
        except BaseException as e:
            status = status_of(e)
            raise
        finally:
            call.end(status)

    async def _prefill(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                       descriptor: TransferDescriptor, priority: int, cache_salt: str | None, tenant: str | None,
                       call: CallTrace | Untraced) -> PrefillResult:
        from tandem.kv_transfer.connector import first_token_of

        self._check_not_aborted(request_id)
        called = time.monotonic()
        stream = self.server.open_stream(request_id)
        try:
            await self.server.call(lambda _e: self.connector.submit(request_id, prompt_token_ids, params, descriptor,
                                                                    priority=priority, cache_salt=cache_salt,
                                                                    tenant=tenant))
        except BaseException:
            self.server.close_stream(request_id)
            raise
        first = None
        try:
            async for output in self.server.stream(request_id, stream):
                if output.token_ids:
                    first = output
        except TransferFailedError:  # ended by the connector (see _transfer_failed): its outcome is this error
            await self.server.call(lambda _e: self.transfers.forget(request_id))
            raise
        if first is None:
            raise TransferFailedError(request_id, TransferState.ABORTED, "the prefill was aborted")
        sampled = time.monotonic()
        if first.scheduled_at is not None:
            call.mark("queue", first.scheduled_at)
        call.mark("compute", sampled)
        call.set("gen_ai.usage.input_tokens", first.num_prompt_tokens)
        call.set("tandem.cached_tokens", first.num_cached_tokens)
        event = await self.transfers.wait(self.server, request_id)
        call.mark("kv_send")
        if event.state is not TransferState.DONE:
            raise TransferFailedError(request_id, event.state, event.error)
        queue_s = 0.0 if first.scheduled_at is None else max(0.0, first.scheduled_at - called)  # the same clock
        return PrefillResult(first_token_of(first), first.num_prompt_tokens, first.num_cached_tokens,
                             transfer_s=time.monotonic() - sampled, queue_s=queue_s)
