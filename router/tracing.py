"""Request traces (OpenTelemetry), off unless the manifest names a collector (`observability.otlp_endpoint`): with
it off the router creates no tracer, no span and no exporter.

Each request becomes one trace, written by the router when the request ends from what it measured along the way,
with the client's W3C `traceparent` (an HTTP header or gRPC metadata) as its parent when one came:

    tandem.request                  arrival at the router to the last byte (status, tenant, tokens, replicas, route)
      parse                         arrival to the router's run of it: the body read, parsed, authenticated
      admission                     the tenant's rate limits and admission control deciding to let it run
      route                         choosing the replicas (and waiting for a prefill replica with room)
      queue                         waiting for a decode replica with room for the prompt's KV
      prefill                       the prefill call to the first token at the router (pool: where it ran)
        prefill.queue               the prompt waiting in the prefill replica's queue (disaggregated)
        prefill.compute             the prefill replica's compute up to its first token (disaggregated)
        kv_transfer                 the KV transfer's tail after that first token (disaggregated)
        decode.admission            the decode replica admitting the transferred request
      decode                        the first token to the last
    (event first_token on tandem.request)

The children tile the request's time in order, so their durations add up to the request's. The root is opened
once admission let the request run (begin()), and its traceparent goes with every call on a replica
(replica/contract.py's `trace`), whose own spans (prefill_replica, decode_replica: replica/tracing.py) are its
children beside these; the rest is written when the request ends (record()). A request refused at admission (its
tenant's limits, the admission controller, a draining router) is a trace too, of a root in error with its parse
and admission (refused()).

Exported in batches over OTLP/gRPC to the collector (`otlp_endpoint`, plaintext unless `https://`); tests hand in
an in-memory exporter instead."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tandem.replica.tracing import TracingConfig, clock_offset_ns, tracer_provider
from tandem.router.routing import PREFILL_POOL

__all__ = ["OpenTrace", "RefusedTrace", "RequestTrace", "RequestTracer", "TracingConfig"]


@dataclass(frozen=True)
class OpenTrace:
    """A request's root span while the request runs (RequestTracer.begin): traceparent is its W3C traceparent,
    what each call on a replica carries; offset_ns turns the router's monotonic clock into the spans' (read once,
    so that the phases tile the root exactly)."""

    span: Any
    traceparent: str
    offset_ns: int
    arrival: float  # the request's arrival (monotonic seconds): the root's start


@dataclass(frozen=True)
class RequestTrace:
    """What the router measured of one request, on the monotonic clock (seconds). first/last: its first and last
    token (None: none came). queue_s, prefill_s, transfer_s, admission_s: as Timings has them."""

    request_id: str
    api: str
    code: str
    entered: float  # when the router took it to run (parsed): admission's start
    started: float  # when admission let it run
    end: float
    first: float | None = None
    last: float | None = None
    queue_s: float = 0.0
    prefill_s: float = 0.0
    prefill_queue_s: float = 0.0  # of prefill_s, the prefill replica's queue
    transfer_s: float = 0.0
    admission_s: float = 0.0
    prefill_route: str = ""
    prefill_replica: str = ""
    decode_replica: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    tenant: str | None = None


@dataclass(frozen=True)
class RefusedTrace:
    """A request refused before it ran, on the monotonic clock (seconds): arrival, decided (when the refusing check
    began: what came before was parsing), end. code: its status (RESOURCE_EXHAUSTED, UNAVAILABLE); reason: which
    check refused it (router/serving.py's refusal_reason)."""

    api: str
    code: str
    reason: str
    tenant: str | None
    arrival: float
    decided: float
    end: float
    request_id: str = ""


class RequestTracer:
    def __init__(self, config: TracingConfig, *, exporter: Any = None):
        """exporter: an OpenTelemetry SpanExporter that gets each span as it ends (tests); None: the collector at
        config.otlp_endpoint, in batches."""
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = tracer_provider(config, "router", exporter=exporter)
        self.tracer = self.provider.get_tracer("tandem.router")
        self._propagator = TraceContextTextMapPropagator()

    def begin(self, trace_parent: str | None, arrival: float) -> OpenTrace:
        """Opens a request's root span from its arrival (monotonic), under the client's traceparent when one
        came (trace_parent; a malformed one is ignored: the trace then starts here)."""
        from opentelemetry.trace import SpanKind, set_span_in_context

        offset = clock_offset_ns()
        parent = self._propagator.extract({"traceparent": trace_parent}) if trace_parent else None
        root = self.tracer.start_span("tandem.request", context=parent, kind=SpanKind.SERVER,
                                      start_time=int(arrival * 1e9) + offset)
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, context=set_span_in_context(root))
        return OpenTrace(root, carrier["traceparent"], offset, arrival)

    def record(self, opened: OpenTrace, t: RequestTrace) -> None:
        """Writes the request's phases under its root and ends it (see the module docstring)."""
        from opentelemetry.trace import Status, StatusCode, set_span_in_context

        def ns(at: float) -> int:
            return int(at * 1e9) + opened.offset_ns

        root = opened.span
        root.set_attributes(_request_attributes(t))
        if t.code != "OK":
            root.set_status(Status(StatusCode.ERROR, t.code))
        inside = set_span_in_context(root)

        def child(name: str, start: float, end: float, context=inside, **attributes) -> Any:
            span = self.tracer.start_span(name, context=context, start_time=ns(start), attributes=attributes or None)
            span.end(end_time=ns(max(start, end)))
            return span

        child("parse", opened.arrival, t.entered)
        child("admission", t.entered, t.started)
        if t.first is None:
            child("route", t.started, t.end)
        else:
            prefill_start = max(t.started, t.first - t.prefill_s)
            queue_start = max(t.started, prefill_start - t.queue_s)
            child("route", t.started, queue_start)
            child("queue", queue_start, prefill_start)
            pool = "prefill" if t.prefill_route == PREFILL_POOL else "decode"
            prefill = self.tracer.start_span("prefill", context=inside, start_time=ns(prefill_start),
                                             attributes={"tandem.pool": pool, "tandem.route": t.prefill_route})
            if pool == "prefill":
                within = set_span_in_context(prefill)
                admission_start = max(prefill_start, t.first - t.admission_s)
                transfer_start = max(prefill_start, admission_start - t.transfer_s)
                compute_start = min(transfer_start, prefill_start + t.prefill_queue_s)
                child("prefill.queue", prefill_start, compute_start, within, **{"tandem.replica": t.prefill_replica})
                child("prefill.compute", compute_start, transfer_start, within, **{"tandem.replica": t.prefill_replica})
                child("kv_transfer", transfer_start, admission_start, within)
                child("decode.admission", admission_start, t.first, within, **{"tandem.replica": t.decode_replica})
            prefill.end(end_time=ns(t.first))
            root.add_event("first_token", timestamp=ns(t.first))
            child("decode", t.first, t.end, **{"tandem.replica": t.decode_replica})
        root.end(end_time=ns(t.end))

    def refused(self, trace_parent: str | None, t: RefusedTrace) -> None:
        """Writes the trace of a request refused before it ran: its root in error (under the client's traceparent
        when one came), its parse and its admission, which carries the reason."""
        from opentelemetry.trace import Status, StatusCode, set_span_in_context

        opened = self.begin(trace_parent, t.arrival)

        def ns(at: float) -> int:
            return int(at * 1e9) + opened.offset_ns

        root = opened.span
        root.set_attributes({"tandem.request_id": t.request_id, "tandem.api": t.api, "tandem.status": t.code,
                             "tandem.tenant": t.tenant or "", "tandem.refused": t.reason})
        root.set_status(Status(StatusCode.ERROR, t.code))
        inside = set_span_in_context(root)
        for name, start, end, attributes in (("parse", t.arrival, t.decided, None),
                                             ("admission", t.decided, t.end, {"tandem.refused": t.reason})):
            span = self.tracer.start_span(name, context=inside, start_time=ns(start), attributes=attributes)
            span.end(end_time=ns(max(start, end)))
        root.end(end_time=ns(max(t.decided, t.end)))

    def shutdown(self) -> None:
        """Sends what is still buffered and stops the exporter."""
        self.provider.shutdown()


def _request_attributes(t: RequestTrace) -> dict[str, Any]:
    return {"tandem.request_id": t.request_id, "tandem.api": t.api, "tandem.status": t.code,
            "tandem.prefill_replica": t.prefill_replica, "tandem.decode_replica": t.decode_replica,
            "gen_ai.usage.input_tokens": t.prompt_tokens, "gen_ai.usage.output_tokens": t.completion_tokens,
            "tandem.cached_tokens": t.cached_tokens, "tandem.tenant": t.tenant or ""}
