"""Request traces (router/tracing.py) through the router actor's real front doors over mock replicas (disaggregated),
into the OpenTelemetry SDK's in-memory exporter: one tree per request under the client's W3C traceparent (HTTP
header or gRPC metadata), its phases tiling the request in order, the root's duration the client's latency within
5%; a request refused at admission is a trace in error saying which check refused it; and with tracing off, no
tracer at all. tests/cluster/test_openai_http.py checks the same through a real
cluster and an OTLP collector."""

from __future__ import annotations

import asyncio
import secrets
import time

import grpc
import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tandem.proto.v1 import tandem_pb2_grpc as pb_grpc
from tandem.replica.contract import ReadyReplica
from tandem.router import router_actor
from tandem.router.client import build_request
from tandem.router.driver_settings import DriverSettings
from tandem.router.limits import ServingLimits, TenantLimits
from tandem.router.mocks.replicas import MockDecode, MockPrefill
from tandem.router.rate_limits import TenantRates
from tandem.router.tracing import RequestTracer, TracingConfig
from tests.router.router_harness import BackgroundLoop
from tests.router.test_http_api import MODEL, embedded

TOKENS = 48
PHASES = ["parse", "admission", "route", "queue", "prefill", "decode"]


class TracedRouter(BackgroundLoop):
    """RouterActor in this process over a mock prefill and decode replica, its tracer writing into memory."""

    def __init__(self, monkeypatch, *, traced: bool = True):
        super().__init__()
        monkeypatch.setattr(router_actor, "load_model_info", lambda path: embedded())
        self.spans = InMemorySpanExporter()

        async def boot():
            self.replicas = replicas = [MockPrefill("prefill-0", step_s=0.01), MockDecode("decode-0", step_s=0.02)]
            ready = [ReadyReplica(r.name, r.pool, r, await r.ready()) for r in replicas]
            self.actor = router_actor.RouterActor(None, DriverSettings())
            endpoints = await self.actor.start(ready, "127.0.0.1:0", "127.0.0.1:0")
            if traced:
                self.actor.serving.tracer = RequestTracer(TracingConfig("http://unused:4317"), exporter=self.spans)
            return endpoints

        endpoints = self.run(boot())
        self.grpc, self.http = endpoints["grpc"], endpoints["http"]

    def close(self) -> None:
        self.run(self.actor.stop(0))
        self.stop()


@pytest.fixture
def router(monkeypatch):
    r = TracedRouter(monkeypatch)
    yield r
    r.close()


def traceparent() -> tuple[str, str, str]:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def tree(spans) -> tuple[object, dict[str, object], dict[int, list]]:
    """(the root, spans by name, children by parent span id); checks they share one trace and every parent is in
    it but the root's."""
    [root] = [s for s in spans if s.name == "tandem.request"]
    by_id = {s.context.span_id: s for s in spans}
    children: dict[int, list] = {}
    for s in spans:
        assert s.context.trace_id == root.context.trace_id
        if s is not root:
            assert s.parent.span_id in by_id, s.name
            children.setdefault(s.parent.span_id, []).append(s)
    return root, {s.name: s for s in spans}, children


def check_phases(root, named, children) -> None:
    """The root's children are the phases in order, each starting where the one before ended, and together as
    long as the root; the prefill replica's part splits the prefill span the same way."""
    phases = sorted(children[root.context.span_id], key=lambda s: s.start_time)
    assert [s.name for s in phases] == PHASES
    assert phases[0].start_time == root.start_time and phases[-1].end_time == root.end_time
    for before, after in zip(phases, phases[1:]):
        assert before.end_time == after.start_time, (before.name, after.name)
    inside = sorted(children[named["prefill"].context.span_id], key=lambda s: s.start_time)
    assert [s.name for s in inside] == ["prefill.queue", "prefill.compute", "kv_transfer", "decode.admission"]
    for before, after in zip(inside, inside[1:]):
        assert before.end_time == after.start_time, (before.name, after.name)
    assert inside[0].start_time == named["prefill"].start_time and inside[-1].end_time == named["prefill"].end_time
    assert [e.name for e in root.events] == ["first_token"]
    assert root.events[0].timestamp == named["decode"].start_time


def test_an_http_request_is_one_trace_under_the_clients_traceparent(router):
    header, trace_id, span_id = traceparent()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": TOKENS,
            "ignore_eos": True}
    with httpx.Client(timeout=30) as client:
        client.post(f"http://{router.http}/v1/chat/completions", json=body)  # first-call costs: not the router's
        router.spans.clear()
        sent = time.monotonic()
        reply = client.post(f"http://{router.http}/v1/chat/completions", json=body, headers={"traceparent": header})
        latency = time.monotonic() - sent
    assert reply.status_code == 200
    root, named, children = tree(router.spans.get_finished_spans())
    assert f"{root.context.trace_id:032x}" == trace_id and f"{root.parent.span_id:016x}" == span_id
    check_phases(root, named, children)
    duration = (root.end_time - root.start_time) / 1e9
    assert abs(duration - latency) <= 0.05 * latency, (duration, latency)
    attributes = root.attributes
    assert attributes["tandem.status"] == "OK" and attributes["gen_ai.usage.output_tokens"] == TOKENS
    assert (attributes["tandem.prefill_replica"], attributes["tandem.decode_replica"]) == ("prefill-0", "decode-0")
    assert named["prefill"].attributes["tandem.pool"] == "prefill"
    # the prefill and the decode call carried the root's context: the replicas' spans go under it
    prefill, decode = router.replicas
    assert prefill.traces[-1] == decode.traces[-1] == f"00-{trace_id}-{root.context.span_id:016x}-01"


def test_a_grpc_request_takes_its_traceparent_from_the_metadata(router):
    header, trace_id, _ = traceparent()

    async def call():
        async with grpc.aio.insecure_channel(router.grpc) as channel:
            stub = pb_grpc.TandemStub(channel)
            request = build_request(prompt="Hello there", max_tokens=4, ignore_eos=True)
            return [r async for r in stub.Generate(request, metadata=(("traceparent", header),))]

    assert asyncio.run(call())
    root, named, children = tree(router.spans.get_finished_spans())
    assert f"{root.context.trace_id:032x}" == trace_id and root.attributes["tandem.api"] == "grpc"
    check_phases(root, named, children)


def test_without_a_traceparent_a_request_starts_its_own_trace(router):
    reply = httpx.post(f"http://{router.http}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 3},
                       timeout=30)
    assert reply.status_code == 200
    root, _, _ = tree(router.spans.get_finished_spans())
    assert root.parent is None


def refused_trace(router, trace_id: str):
    spans = [s for s in router.spans.get_finished_spans() if f"{s.context.trace_id:032x}" == trace_id]
    root, named, children = tree(spans)
    assert [s.name for s in sorted(children[root.context.span_id], key=lambda s: s.start_time)] == \
        ["parse", "admission"]
    assert named["parse"].end_time == named["admission"].start_time and named["admission"].end_time == root.end_time
    assert not root.status.is_ok
    return root, named


def test_a_request_refused_by_its_rate_limit_is_a_trace_saying_so(router):
    from prometheus_client import CollectorRegistry

    limits = ServingLimits(default_tenant=TenantLimits(requests_per_minute=1))
    router.actor.serving.rates = TenantRates(limits, CollectorRegistry())
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    with httpx.Client(timeout=30) as client:
        assert client.post(f"http://{router.http}/v1/completions", json=body).status_code == 200
        header, trace_id, span_id = traceparent()
        refused = client.post(f"http://{router.http}/v1/completions", json=body, headers={"traceparent": header})
    assert refused.status_code == 429
    root, named = refused_trace(router, trace_id)
    assert f"{root.parent.span_id:016x}" == span_id
    assert root.attributes["tandem.status"] == "RESOURCE_EXHAUSTED"
    assert named["admission"].attributes["tandem.refused"] == "rate_limit:requests"


def test_a_grpc_request_refused_while_draining_is_a_trace_saying_so(router):
    header, trace_id, _ = traceparent()
    router.actor.serving.draining = True

    async def call():
        async with grpc.aio.insecure_channel(router.grpc) as channel:
            stub = pb_grpc.TandemStub(channel)
            request = build_request(prompt="Hello there", max_tokens=4)
            return [r async for r in stub.Generate(request, metadata=(("traceparent", header),))]

    with pytest.raises(grpc.aio.AioRpcError) as refused:
        asyncio.run(call())
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    root, named = refused_trace(router, trace_id)
    assert root.attributes["tandem.api"] == "grpc" and root.attributes["tandem.status"] == "UNAVAILABLE"
    assert named["admission"].attributes["tandem.refused"] == "draining"
    router.actor.serving.draining = False


def test_with_tracing_off_the_router_has_no_tracer(monkeypatch):
    r = TracedRouter(monkeypatch, traced=False)
    try:
        assert httpx.post(f"http://{r.http}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2},
                          timeout=30).status_code == 200
        assert r.actor.serving.tracer is None
        assert [trace for replica in r.replicas for trace in replica.traces] == [None, None]  # prefill, decode
    finally:
        r.close()
