"""An OpenTelemetry collector's OTLP/gRPC trace endpoint for tests and benchmarks: a gRPC server on a free loopback
port that keeps every span it is sent (with the component that sent it), for a cluster whose manifest names it
(observability.otlp_endpoint). tests/cluster/test_openai_http.py reads the traces; bench/cluster_serving.py counts
what tracing sent."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, collector: OTLPCollector):
        self.collector = collector

    def Export(self, request, context):
        with self.collector.lock:
            for resource_spans in request.resource_spans:
                component = next((a.value.string_value for a in resource_spans.resource.attributes
                                  if a.key == "tandem.component"), "")
                for scope_spans in resource_spans.scope_spans:
                    self.collector.spans.extend((component, span) for span in scope_spans.spans)
        return trace_service_pb2.ExportTraceServiceResponse()


class OTLPCollector:
    def __init__(self):
        self.lock = threading.Lock()
        self.spans: list[tuple[str, object]] = []  # (tandem.component, opentelemetry.proto Span)
        self.server = grpc.server(ThreadPoolExecutor(2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(self), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def trace(self, trace_id: str, *, names: tuple[str, ...] = ("tandem.request",), timeout_s: float = 20.0) -> list:
        """The spans of the trace with hex id trace_id, once one of each name in names has arrived (the router and
        the replicas export in batches) or timeout_s passed."""
        deadline = time.monotonic() + timeout_s
        while True:
            spans = [span for _, span in self.spans_of(trace_id)]
            if set(names) <= {span.name for span in spans} or time.monotonic() > deadline:
                return spans
            time.sleep(0.1)

    def spans_of(self, trace_id: str) -> list[tuple[str, object]]:
        """(the sender's tandem.component, span) for the spans of trace trace_id received so far."""
        wanted = bytes.fromhex(trace_id)
        with self.lock:
            return [(component, span) for component, span in self.spans if span.trace_id == wanted]

    def close(self) -> None:
        self.server.stop(0)
