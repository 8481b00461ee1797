"""The gRPC front door: tandem.v1.Tandem (Generate, Abort, ListModels) beside the standard grpc.health.v1 health
service and server reflection, on grpc.aio. Errors map to status codes here and nowhere else."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tandem.engine.output_processor import RequestOutput
from tandem.proto.v1 import tandem_pb2 as pb
from tandem.proto.v1 import tandem_pb2_grpc as pb_grpc
from tandem.router.lifecycle import (NoCapacityError, NoReplicaError, Progress, ReplicaLostError, RequestDriver,
                                     is_replica_death)
from tandem.router.request_parsing import InvalidRequest, ModelFacts, ParsedRequest, parse_request

_log = logging.getLogger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Tandem"].full_name


def status_for(error: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status a failed request ends with, and its message."""
    if isinstance(error, InvalidRequest):
        return getattr(grpc.StatusCode, error.code), str(error)
    if isinstance(error, NoCapacityError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(error)
    if isinstance(error, (NoReplicaError, ReplicaLostError)):
        return grpc.StatusCode.UNAVAILABLE, str(error)
    if is_replica_death(error):
        return grpc.StatusCode.UNAVAILABLE, f"a replica serving the request died: {error}"
    if isinstance(error, ValueError):  # the engine's own validation (RequestRejectedError is one)
        return grpc.StatusCode.INVALID_ARGUMENT, str(error).splitlines()[-1] if str(error) else repr(error)
    return grpc.StatusCode.INTERNAL, f"internal error: {error!r}"


class _Accounting:
    """Usage and timings of one request, from the outputs the router forwards."""

    def __init__(self, arrival: float):
        self.arrival = arrival
        self.first = self.last = None
        self.completion_tokens = 0
        self.prompt_tokens = self.cached_tokens = 0
        self.queue_s = self.prefill_s = 0.0

    def observe(self, progress: Progress, now: float) -> None:
        if progress.queue_s or progress.prefill_s:  # the first progress of a request carries them
            self.queue_s, self.prefill_s = progress.queue_s, progress.prefill_s
        if progress.num_cached_tokens is not None:  # disaggregated: the prefill replica's cache hits
            self.cached_tokens = progress.num_cached_tokens
        for output in progress.outputs:
            if progress.num_cached_tokens is None:
                self.cached_tokens = max(self.cached_tokens, output.num_cached_tokens)
            self.prompt_tokens = output.num_prompt_tokens
            if output.token_ids:
                self.completion_tokens += len(output.token_ids)
                self.first = self.first if self.first is not None else now
                self.last = now

    def usage(self) -> pb.Usage:
        return pb.Usage(prompt_tokens=self.prompt_tokens, cached_tokens=self.cached_tokens,
                        completion_tokens=self.completion_tokens)

    def timings(self, now: float) -> pb.Timings:
        first = self.first if self.first is not None else now
        gaps = self.completion_tokens - 1
        itl = (self.last - self.first) / gaps if gaps > 0 and self.first is not None else 0.0
        return pb.Timings(ttft_s=first - self.arrival, mean_itl_s=itl, e2e_s=now - self.arrival,
                          queue_s=self.queue_s, prefill_s=self.prefill_s)


def _response(output: RequestOutput) -> pb.GenerateResponse:
    response = pb.GenerateResponse(request_id=output.request_id, index=output.index, text=output.text,
                                   token_ids=list(output.token_ids), finish_reason=output.finish_reason or "")
    for lp in output.logprobs or ():
        response.logprobs.add(token_id=lp.token_id, logprob=lp.logprob,
                              top=[pb.TopLogprob(token_id=t, logprob=p) for t, p in lp.top_logprobs])
    return response


class TandemServicer(pb_grpc.TandemServicer):
    def __init__(self, driver: RequestDriver, model: ModelFacts, mode: str):
        self.driver = driver
        self.model = model
        self.mode = mode
        self.active: dict[str, asyncio.Task] = {}
        self._abort_calls: set[str] = set()  # ids whose task an Abort call cancelled (not a gone client)
        self.num_finished = 0
        self.num_failed = 0

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        arrival = time.monotonic()
        try:
            parsed = parse_request(request, self.model)
        except InvalidRequest as e:
            await context.abort(getattr(grpc.StatusCode, e.code), str(e))
        if parsed.request_id in self.active:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request id {parsed.request_id!r} is in use")
        self.active[parsed.request_id] = asyncio.current_task()
        code = None
        try:
            async for response in self._stream(parsed, arrival):
                yield response
        except asyncio.CancelledError:
            if parsed.request_id not in self._abort_calls:
                raise  # the client went away: nobody to answer
            code, message = grpc.StatusCode.CANCELLED, f"request {parsed.request_id!r} was aborted"
        except Exception as e:
            code, message = status_for(e)
            if code is grpc.StatusCode.INTERNAL:
                _log.exception("request %s failed", parsed.request_id)
        finally:
            self.active.pop(parsed.request_id, None)
            self._abort_calls.discard(parsed.request_id)
        if code is not None:
            self.num_failed += 1
            await context.abort(code, message)
        self.num_finished += 1

    async def _stream(self, parsed: ParsedRequest, arrival: float):
        account = _Accounting(arrival)
        first = True
        async for progress in self.driver.run(parsed):
            now = time.monotonic()
            account.observe(progress, now)
            for output in progress.outputs:
                response = _response(output)
                if first:
                    response.prefill_replica = progress.prefill_replica
                    response.decode_replica = progress.decode_replica
                    first = False
                if output.finished:
                    response.usage.CopyFrom(account.usage())
                    response.timings.CopyFrom(account.timings(now))
                yield response

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        task = self.active.get(request.request_id)
        if task is not None:
            self._abort_calls.add(request.request_id)
            task.cancel()
        return pb.AbortResponse(found=task is not None)

    async def ListModels(self, request: pb.ListModelsRequest, context) -> pb.ListModelsResponse:
        return pb.ListModelsResponse(models=[pb.Model(id=self.model.model_id, max_model_len=self.model.max_model_len,
                                                      mode=self.mode)])


async def start_grpc_server(servicer: TandemServicer, address: str) -> tuple[grpc.aio.Server, int,
                                                                              health.aio.HealthServicer]:
    """Starts the server on address (HOST:PORT; port 0 picks a free one). Returns it, its port and its health
    servicer (SERVING for "" and tandem.v1.Tandem). Raises RuntimeError if the address cannot be bound."""
    server = grpc.aio.server()
    pb_grpc.add_TandemServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server)
    try:
        port = server.add_insecure_port(address)
    except RuntimeError as e:
        raise RuntimeError(f"cannot listen on {address}: {e}") from None
    await server.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, port, health_servicer
