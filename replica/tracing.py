"""Request traces inside the replicas (OpenTelemetry), the replicas' half of router/tracing.py: off unless the
manifest names a collector (`observability.otlp_endpoint`); with it off a replica creates no tracer and no span,
and a call the router does not trace (trace None) creates nothing either.

The router passes each call the W3C traceparent of the request's span (`trace`, replica/contract.py); the replica
writes one span per call under it when the call ends, with a child per phase, the phases tiling the call in order:

    prefill_replica     prefill(): queue (to the engine's first scheduling of the prompt), compute (to its first
                        token), kv_send (to every decode rank's acknowledgement of the KV)
    decode_replica      decode(): kv_wait (to the transfer's end), admission (to the request running with its
                        first token), decode (to its last output)
                        generate() and resume(): queue, prefill (to the first output), decode (to the last)

Times are the replica's monotonic clock turned into wall-clock nanoseconds, as the router's are. Exported in
batches over OTLP/gRPC to the collector; tests hand in an exporter of their own."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator

if TYPE_CHECKING:
    from tandem.engine.core.output_processor import RequestOutput

EXPORT_DELAY_MS = 1000  # how long finished spans wait before a batch goes to the collector


@dataclass(frozen=True)
class TracingConfig:
    """otlp_endpoint: the OpenTelemetry collector's OTLP/gRPC address ("http://host:4317"); None: no traces.
    service_name: the traces' service.name (every component's: the router's and the replicas')."""

    otlp_endpoint: str | None = None
    service_name: str = "tandem"


def tracer_provider(config: TracingConfig, component: str, *, instance: str | None = None, exporter: Any = None):
    """An OpenTelemetry TracerProvider whose spans carry service.name config.service_name, tandem.component
    component ("router", "prefill", "decode") and service.instance.id instance. exporter: gets each span as it
    ends (tests); None: the collector at config.otlp_endpoint, in batches (plaintext unless https://)."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    attributes = {"service.name": config.service_name, "tandem.component": component}
    if instance is not None:
        attributes["service.instance.id"] = instance
    provider = TracerProvider(resource=Resource.create(attributes))
    if exporter is None:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        endpoint = config.otlp_endpoint or ""
        exporter = OTLPSpanExporter(endpoint=endpoint, insecure=not endpoint.startswith("https://"))
        provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=EXPORT_DELAY_MS))
    else:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider


def clock_offset_ns() -> int:
    """What turns a time.monotonic() reading into wall-clock nanoseconds since the epoch (what spans carry):
    int(at * 1e9) + this. Read once per trace, so that the spans of one trace tile exactly."""
    return time.time_ns() - time.monotonic_ns()


class CallTrace:
    """The phases of one traced replica call as they pass (monotonic seconds), written as one span when it ends."""

    def __init__(self, tracer: ReplicaTracer, trace: str, name: str, request_id: str):
        self.tracer, self.trace, self.name = tracer, trace, name
        self.start = time.monotonic()
        self.phases: list[tuple[str, float]] = []  # (phase, its end), in order
        self.attributes: dict[str, Any] = {"tandem.request_id": request_id}

    def mark(self, phase: str, at: float | None = None) -> None:
        """Phase `phase` ended at `at` (None: now); it began where the one before ended (the call's start). The
        last phase marked lasts to the call's end."""
        self.phases.append((phase, time.monotonic() if at is None else at))

    def set(self, key: str, value: Any) -> None:
        """An attribute of the call's span."""
        self.attributes[key] = value

    def end(self, status: str = "OK") -> None:
        """Writes the call's span, its status `status` (an error's name otherwise), and one child per phase."""
        self.tracer.write(self, status, time.monotonic())


def status_of(error: BaseException) -> str:
    """A call's span status for the error it ended with: CANCELLED when its caller went away, else the error's
    class name."""
    return "CANCELLED" if isinstance(error, (GeneratorExit, asyncio.CancelledError)) else type(error).__name__


class Untraced:
    """What a call the router does not trace, or a replica without a tracer, records: nothing."""

    def mark(self, phase: str, at: float | None = None) -> None:
        pass

    def set(self, key: str, value: Any) -> None:
        pass

    def end(self, status: str = "OK") -> None:
        pass


UNTRACED = Untraced()


class ReplicaTracer:
    def __init__(self, config: TracingConfig, replica: str, pool: str, *, exporter: Any = None):
        """replica, pool: the replica's name and pool (the spans' resource). exporter: as tracer_provider's."""
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = tracer_provider(config, pool, instance=replica, exporter=exporter)
        self.tracer = self.provider.get_tracer(f"tandem.{pool}_replica")
        self.replica = replica
        self._propagator = TraceContextTextMapPropagator()

    def call(self, trace: str | None, name: str, request_id: str) -> CallTrace | Untraced:
        """The recorder of one call (starting now) under the router's traceparent `trace`; UNTRACED for None."""
        return UNTRACED if trace is None else CallTrace(self, trace, name, request_id)

    def write(self, call: CallTrace, status: str, end: float) -> None:
        from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context

        offset = clock_offset_ns()

        def ns(at: float) -> int:
            return int(at * 1e9) + offset

        parent = self._propagator.extract({"traceparent": call.trace})
        span = self.tracer.start_span(call.name, context=parent, kind=SpanKind.SERVER, start_time=ns(call.start),
                                      attributes={**call.attributes, "tandem.replica": self.replica,
                                                  "tandem.status": status})
        if status != "OK":
            span.set_status(Status(StatusCode.ERROR, status))
        inside, begin = set_span_in_context(span), call.start
        for i, (phase, until) in enumerate(call.phases):  # the last phase lasts to the call's end
            until = end if i == len(call.phases) - 1 else min(max(begin, until), end)
            self.tracer.start_span(phase, context=inside, start_time=ns(begin)).end(end_time=ns(until))
            begin = until
        span.end(end_time=ns(end))

    def shutdown(self) -> None:
        """Sends what is still buffered and stops the exporter."""
        self.provider.shutdown()


def traced_stream(call: CallTrace | Untraced, batches: AsyncIterator[list[RequestOutput]], *,
                  first_phases: tuple[str, ...] = ()) -> AsyncIterator[list[RequestOutput]]:
    """The batches of a streaming call, its phases marked as they pass (an untraced call's: the stream itself,
    nothing in between): with first_phases ("queue", "prefill"), the first batch ends the second and its first
    output's scheduled_at (the engine's first scheduling, when it carries one) the first; the stream's end ends
    "decode"; then the call's span is written, its status the error's name if the stream raised, CANCELLED if
    the caller stopped reading."""
    return batches if isinstance(call, Untraced) else _traced_stream(call, batches, first_phases)


async def _traced_stream(call: CallTrace, batches: AsyncIterator[list[RequestOutput]],
                         first_phases: tuple[str, ...]) -> AsyncIterator[list[RequestOutput]]:
    status, first = "CANCELLED", True
    tokens = 0
    try:
        async for batch in batches:
            if first and first_phases:
                scheduled = next((o.scheduled_at for o in batch if o.scheduled_at is not None), None)
                if scheduled is not None:
                    call.mark(first_phases[0], scheduled)
                call.mark(first_phases[-1])
            first = False
            tokens += sum(len(o.token_ids) for o in batch)
            yield batch
        status = "OK"
    except Exception as e:
        status = status_of(e)
        raise
    finally:
        call.mark("decode")
        call.set("gen_ai.usage.output_tokens", tokens)
        call.end(status)
