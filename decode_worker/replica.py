"""One decode replica (PP stages x EP ranks x TP ranks): the Ray actor class the control plane starts in its
placement group. It serves two kinds of request besides the calls every replica answers (the shell's,
replica/shell.py; the contract is replica/contract.py's DecodeReplicaAPI):

  - transferred (disaggregated): reserve() holds blocks for a prompt and returns the transfer descriptor the
    prefill replica pushes into; decode() waits for the KV to arrive, continues the request from the prefill
    replica's first token and streams the rest;
  - local (colocated mode, n > 1, or the router's fallback after a failed transfer): generate() prefills and
    decodes here;
  - resumed (the router's migration after the decode replica serving a request died): resume() prefills the
    prompt plus the tokens already delivered and streams what comes after them (engine/core/resume.py).

Streams yield lists of RequestOutput: everything produced since the consumer's last read, so one message per
engine step at most crosses to the router, however many tokens it carries.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, AsyncIterator, Sequence

from tandem.engine.core.output_processor import RequestOutput
from tandem.engine.core.resume import ResumeState
from tandem.engine.sampled_token import SampledToken
from tandem.engine.sampling_params import SamplingParams
from tandem.kv_transfer.config import TransferConfig
from tandem.kv_transfer.descriptor import TransferDescriptor, TransferFailedError, TransferState
from tandem.replica.contract import STREAM_CALLS
from tandem.replica.shell import ReplicaShell
from tandem.replica.spec import ReplicaSpec
from tandem.replica.tracing import CallTrace, TracingConfig, Untraced, status_of, traced_stream

if TYPE_CHECKING:  # the runtime is imported when the replica is built (replica/shell.py says why)
    from tandem.kv_transfer.connector import DecodeConnector

LOCAL_PHASES = ("queue", "prefill")  # a request prefilled here: its phases up to its first output (then decode)


class DecodeReplica(ReplicaShell):
    pool = "decode"
    streams = STREAM_CALLS
    connector: DecodeConnector | None

    def __init__(self, name: str, spec: ReplicaSpec, transfer: TransferConfig | None, *, settle_heap: bool = False,
                 tracing: TracingConfig | None = None):
        """transfer None: a colocated replica (no KV agents; reserve/decode are refused). transfer.host "": this
        node's address. settle_heap, tracing: ReplicaShell's."""
        from tandem.kv_transfer.connector import DecodeConnector

        super().__init__(name, spec, transfer, DecodeConnector, settle_heap=settle_heap, tracing=tracing)

    async def reserve(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, *,
                      priority: int = 0, cache_salt: str | None = None, senders: tuple[str, ...] = (),
                      tenant: str | None = None, waited_s: float = 0.0) -> TransferDescriptor | None:
        """Holds blocks for the prompt's KV (cache_salt: the tenant's prefix-cache salt); None when there is no
        room now. senders: the prefill replica's agent addresses by rank, the only peers told how the transfer
        went (empty: nobody). waited_s: how long it has waited for room (DecodeReplicaAPI.reserve). Raises
        ValueError / RequestRejectedError for a request this replica cannot serve."""
        if self.connector is None:
            raise ValueError(f"decode replica {self.name} is colocated: it takes no KV transfers")
        self._check_not_aborted(request_id)
        return await self.server.call(
            lambda _e: self.connector.reserve(request_id, prompt_token_ids, params, priority=priority,
                                              cache_salt=cache_salt, senders=tuple(senders), tenant=tenant,
                                              waited_s=waited_s))

    async def decode(self, request_id: str, first_token: SampledToken, *,
                     trace: str | None = None) -> AsyncIterator[list[RequestOutput]]:
        """Waits for the reserved request's KV, admits it with first_token and streams its outputs (the first
        one carries first_token). trace: the router's traceparent (a span decode_replica with phases kv_wait,
        admission and decode: replica/tracing.py). Raises TransferFailedError if the transfer ended badly (blocks
        are free)."""
        if self.connector is None:
            raise ValueError(f"decode replica {self.name} is colocated: it takes no KV transfers")
        self._check_not_aborted(request_id)
        call = self._trace(trace, "decode_replica", request_id)
        stream = self.server.open_stream(request_id)
        try:
            event = await self.transfers.wait(self.server, request_id)
            call.mark("kv_wait")
            if event.state is not TransferState.DONE:
                raise TransferFailedError(request_id, event.state, event.error)

            def admit(_engine) -> None:
                for output in self.connector.admit(request_id, first_token):
                    self.server.deliver(request_id, output, final=output.finished)

            await self.server.call(admit)
            call.mark("admission")
        except BaseException as e:
            self.server.close_stream(request_id)
            await self.abort(request_id)
            call.end(status_of(e))
            raise
        async for batch in traced_stream(call, self.server.batches(request_id, stream)):
            yield batch

    async def generate(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, *,
                       priority: int = 0, cache_salt: str | None = None, tenant: str | None = None,
                       trace: str | None = None) -> AsyncIterator[list[RequestOutput]]:
        """Prefills and decodes the request here; streams its outputs. trace: the router's traceparent (a span
        decode_replica with phases queue, prefill and decode: replica/tracing.py)."""
        self._check_not_aborted(request_id)
        call = self._trace(trace, "decode_replica", request_id)
        stream = self._add(call, request_id, prompt_token_ids, params, priority=priority, cache_salt=cache_salt,
                           tenant=tenant)
        async for batch in traced_stream(call, self.server.batches(request_id, stream), first_phases=LOCAL_PHASES):
            yield batch

    async def resume(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                     resume: ResumeState, *, priority: int = 0, cache_salt: str | None = None,
                     tenant: str | None = None, trace: str | None = None) -> AsyncIterator[list[RequestOutput]]:
        """Continues a request another decode replica was serving (colocated replicas too): the engine prefills
        the prompt plus resume.output_token_ids and streams only what comes after them (LLMEngine.add_request's
        resume). trace: as generate's. Raises ValueError for a request that cannot be resumed."""
        self._check_not_aborted(request_id)
        call = self._trace(trace, "decode_replica", request_id)
        call.set("tandem.resumed_tokens", len(resume.output_token_ids))
        stream = self._add(call, request_id, prompt_token_ids, params, priority=priority, cache_salt=cache_salt,
                           resume=resume, tenant=tenant)
        async for batch in traced_stream(call, self.server.batches(request_id, stream), first_phases=LOCAL_PHASES):
            yield batch

    def _add(self, call: CallTrace | Untraced, request_id: str, *args, **kwargs):
        """AsyncEngine.add_request, the call's span written (with the error) when the engine refuses it."""
        try:
            return self.server.add_request(request_id, *args, **kwargs)
        except Exception as e:
            call.end(status_of(e))
            raise
