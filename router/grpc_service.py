"""The gRPC front door: tandem.v1.Tandem (Generate, Abort, ListModels) beside the standard grpc.health.v1 health
service and server reflection, on grpc.aio. A failure's status name comes from serving.error_code; here it becomes
a grpc.StatusCode; a refusal the client should retry later (a tenant past its cap, a cluster that cannot start the
request in time: admission.py) is RESOURCE_EXHAUSTED, a draining router's UNAVAILABLE, each with trailing
metadata `retry-after` (whole seconds, the error's retry_after_s) and gRPC's own `grpc-retry-pushback-ms`. With
API keys on, every Tandem call needs `authorization: Bearer KEY` metadata; the health and reflection services
stay open (probes carry no keys)."""

from __future__ import annotations

import logging
import time

import grpc
from google.protobuf import message_factory
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tandem.engine.core.output_processor import RequestOutput
from tandem.proto.v1 import tandem_pb2 as pb
from tandem.proto.v1 import tandem_pb2_grpc as pb_grpc
from tandem.router.admission import AtCapacity
from tandem.router.auth import Unauthenticated
from tandem.router.request_parsing import InvalidRequest
from tandem.router.serving import Draining, Serving, error_code
from tandem.router.tls import TLSConfig, grpc_server_credentials

_log = logging.getLogger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Tandem"].full_name


def status_for(error: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status a failed request ends with, and its message."""
    code, message = error_code(error)
    return getattr(grpc.StatusCode, code), message


def _response(request_id: str, output: RequestOutput) -> pb.GenerateResponse:
    """request_id: the client's id (the replicas' id is scoped by tenant)."""
    response = pb.GenerateResponse(request_id=request_id, index=output.index, text=output.text,
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

    async def _refuse(self, context: grpc.aio.ServicerContext, error: Exception) -> None:
        """Ends the call with error's status (raises); one to retry later also tells when (retry-after)."""
        if (retry_after_s := getattr(error, "retry_after_s", None)) is not None:  # a refusal to retry later
            context.set_trailing_metadata((("retry-after", str(retry_after_s)),
                                           ("grpc-retry-pushback-ms", str(retry_after_s * 1000))))
        await context.abort(*status_for(error))

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        arrival = time.monotonic()
        trace_parent = dict(context.invocation_metadata() or ()).get("traceparent")
        try:
            tenant = self._tenant(context)
            admission = self.serving.let_in(1, "grpc", tenant, arrival, trace_parent)  # before tokenizing
        except (InvalidRequest, Unauthenticated, AtCapacity, Draining) as e:
            await self._refuse(context, e)
        try:
            parsed = await self.serving.parse(request, tenant, "grpc")
        except BaseException as e:
            admission.close()
            if isinstance(e, InvalidRequest):
                await self._refuse(context, e)
            raise
        remaining = context.time_remaining()  # the client's own gRPC deadline, if it set one
        deadline = self.serving.deadline(arrival, None if remaining is None else max(remaining, 1e-3))
        failure = None
        try:
            first = True
            async for step in self.serving.run(parsed, arrival, "grpc", deadline=deadline, trace_parent=trace_parent):
                for output in step.progress.outputs:
                    response = _response(parsed.request_id, output)
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
            failure = e
        finally:
            admission.close()
        if failure is not None:
            await self._refuse(context, failure)

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        """Aborts the caller's own request of that id (a request of another tenant is not found)."""
        try:
            tenant = self._tenant(context)
        except Unauthenticated as e:
            await context.abort(*status_for(e))
        return pb.AbortResponse(found=self.serving.abort(tenant, request.request_id))

    async def ListModels(self, request: pb.ListModelsRequest, context) -> pb.ListModelsResponse:
        try:
            self._tenant(context)
        except Unauthenticated as e:
            await context.abort(*status_for(e))
        model = self.serving.model
        names = (model.model_id, *self.serving.driver.pools.adapters.names)  # the model, then its LoRA adapters
        return pb.ListModelsResponse(models=[pb.Model(id=name, max_model_len=model.max_model_len,
                                                      mode=self.serving.mode) for name in names])


def _decoding_handlers(servicer: TandemServicer) -> grpc.GenericRpcHandler:
    """tandem.v1.Tandem's methods, each taking the request's raw bytes and decoding them itself: bytes that are
    not a valid message (corrupt wire format, bad UTF-8 in a string) end with INVALID_ARGUMENT and a message,
    where gRPC's own decoding would end the call UNKNOWN before any of our code ran."""
    service = pb.DESCRIPTOR.services_by_name["Tandem"]
    handlers = {}
    for method in service.methods:
        message = message_factory.GetMessageClass(method.input_type)
        serialize = message_factory.GetMessageClass(method.output_type).SerializeToString
        call = getattr(servicer, method.name)
        if method.server_streaming:
            handlers[method.name] = grpc.unary_stream_rpc_method_handler(
                _streaming(call, message), response_serializer=serialize)
        else:
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(
                _unary(call, message), response_serializer=serialize)
    return grpc.method_handlers_generic_handler(service.full_name, handlers)


async def _decode(raw: bytes, message, context: grpc.aio.ServicerContext):
    try:
        return message.FromString(raw)
    except DecodeError as e:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                            f"the request is not a valid {message.DESCRIPTOR.full_name}: {e}")


def _streaming(call, message):
    async def handle(raw: bytes, context: grpc.aio.ServicerContext):
        async for response in call(await _decode(raw, message, context), context):
            yield response
    return handle


def _unary(call, message):
    async def handle(raw: bytes, context: grpc.aio.ServicerContext):
        return await call(await _decode(raw, message, context), context)
    return handle


LIVENESS = "liveness"  # a gRPC health service name SERVING for as long as the router's process serves


async def start_grpc_server(servicer: TandemServicer, address: str, *, max_message_bytes: int = 4 << 20,
                            tls: TLSConfig | None = None) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    """Starts the server on address (HOST:PORT; port 0 picks a free one). Returns it, its port and its health
    servicer (SERVING for "" and tandem.v1.Tandem: drain_health turns those NOT_SERVING; and for LIVENESS, which
    stays SERVING while the process serves, draining included: a liveness probe's name). A request message over
    max_message_bytes is refused by gRPC
    itself (RESOURCE_EXHAUSTED) before it is parsed. tls: serve over TLS (None: plaintext); every service,
    health included, is then TLS-only. Raises RuntimeError if the address cannot be bound, TLSFileError for an
    unusable TLS file."""
    credentials = None if tls is None else grpc_server_credentials(tls)
    # so_reuseport off: a second server on a taken port fails here instead of sharing it with the first.
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", max_message_bytes),
                                      ("grpc.so_reuseport", 0)])
    server.add_generic_rpc_handlers((_decoding_handlers(servicer),))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server)
    try:
        port = (server.add_insecure_port(address) if credentials is None
                else server.add_secure_port(address, credentials))
    except RuntimeError as e:
        raise RuntimeError(f"cannot listen on {address}: {e}") from None
    await server.start()
    for name in ("", SERVICE_NAME, LIVENESS):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, port, health_servicer


async def drain_health(health_servicer: health.aio.HealthServicer) -> None:
    """A draining router's gRPC health: NOT_SERVING for "" and tandem.v1.Tandem (load balancers move away),
    LIVENESS still SERVING (a liveness probe must not kill a router that is finishing its requests)."""
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
