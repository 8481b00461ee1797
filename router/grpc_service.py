"""The gRPC front door: tandem.v1.Tandem (Generate, Abort, ListModels) beside the standard grpc.health.v1 health
service and server reflection, on grpc.aio. A failure's status name comes from serving.error_code; here it becomes
a grpc.StatusCode. With API keys on, every Tandem call needs `authorization: Bearer KEY` metadata; the health
and reflection services stay open (probes carry no keys)."""

from __future__ import annotations

import logging
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tandem.engine.output_processor import RequestOutput
from tandem.proto.v1 import tandem_pb2 as pb
from tandem.proto.v1 import tandem_pb2_grpc as pb_grpc
from tandem.router.auth import Unauthenticated
from tandem.router.request_parsing import InvalidRequest
from tandem.router.serving import Serving, error_code

_log = logging.getLogger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Tandem"].full_name


def status_for(error: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status a failed request ends with, and its message."""
    code, message = error_code(error)
    return getattr(grpc.StatusCode, code), message


def _response(output: RequestOutput) -> pb.GenerateResponse:
    response = pb.GenerateResponse(request_id=output.request_id, index=output.index, text=output.text,
                                   token_ids=list(output.token_ids), finish_reason=output.finish_reason or "")
    for lp in output.logprobs or ():
        response.logprobs.add(token_id=lp.token_id, logprob=lp.logprob,
                              top=[pb.TopLogprob(token_id=t, logprob=p) for t, p in lp.top_logprobs])
    return response


class TandemServicer(pb_grpc.TandemServicer):
    def __init__(self, serving: Serving):
        self.serving = serving

    def _tenant(self, context: grpc.aio.ServicerContext) -> str | None:
        metadata = dict(context.invocation_metadata() or ())
        return self.serving.authenticate(metadata.get("authorization"), "grpc")

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        arrival = time.monotonic()
        try:
            parsed = self.serving.parse(request, self._tenant(context), "grpc")
        except (InvalidRequest, Unauthenticated) as e:
            await context.abort(*status_for(e))
        code = None
        try:
            first = True
            async for step in self.serving.run(parsed, arrival, "grpc"):
                for output in step.progress.outputs:
                    response = _response(output)
                    if first:
                        response.prefill_replica = step.progress.prefill_replica
                        response.decode_replica = step.progress.decode_replica
                        response.prefill_route = step.progress.prefill_route
                        first = False
                    if output.finished:
                        response.usage.CopyFrom(pb.Usage(**vars(step.account.usage())))
                        response.timings.CopyFrom(pb.Timings(**vars(step.account.timings(step.now))))
                    yield response
        except Exception as e:
            code, message = status_for(e)
        if code is not None:
            await context.abort(code, message)

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        try:
            self._tenant(context)
        except Unauthenticated as e:
            await context.abort(*status_for(e))
        return pb.AbortResponse(found=self.serving.abort(request.request_id))

    async def ListModels(self, request: pb.ListModelsRequest, context) -> pb.ListModelsResponse:
        try:
            self._tenant(context)
        except Unauthenticated as e:
            await context.abort(*status_for(e))
        model = self.serving.model
        return pb.ListModelsResponse(models=[pb.Model(id=model.model_id, max_model_len=model.max_model_len,
                                                      mode=self.serving.mode)])


async def start_grpc_server(servicer: TandemServicer, address: str, *, max_message_bytes: int = 4 << 20,
                            ) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    """Starts the server on address (HOST:PORT; port 0 picks a free one). Returns it, its port and its health
    servicer (SERVING for "" and tandem.v1.Tandem). A request message over max_message_bytes is refused by gRPC
    itself (RESOURCE_EXHAUSTED) before it is parsed. Raises RuntimeError if the address cannot be bound."""
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", max_message_bytes)])
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
