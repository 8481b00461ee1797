"""The replicas' spans (replica/tracing.py), from real worker replicas run here in one process (as Ray would run
each actor) into the OpenTelemetry SDK's in-memory exporter: each traced call is one span under the router's
traceparent, its phases tiling it in order (prefill: queue, compute, kv_send; decode: kv_wait, admission, decode;
generate: queue, prefill, decode); a failed call's span says why; an untraced call, or a replica without a
tracer, writes nothing. tests/cluster/test_openai_http.py checks the whole tree through a real cluster."""

from __future__ import annotations

import asyncio
import secrets

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tandem.decode_worker.replica import DecodeReplica
from tandem.engine.engine_config import EngineConfig
from tandem.engine.sampling_params import SamplingParams
from tandem.kv_transfer.config import TransferConfig
from tandem.prefill_worker.replica import PrefillReplica
from tandem.replica.spec import ReplicaSpec
from tandem.replica.tracing import ReplicaTracer, TracingConfig

TOKENS = 5
PARAMS = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)
CONFIG = TracingConfig("http://collector.invalid:4317")


def traced(replica, spans: InMemorySpanExporter):
    replica.tracer = ReplicaTracer(CONFIG, replica.name, replica.pool, exporter=spans)
    return replica


@pytest.fixture(scope="module")
def spans():
    return InMemorySpanExporter()


@pytest.fixture(scope="module")
def replicas(tiny_llama, spans):
    spec = ReplicaSpec(model=str(tiny_llama.source), device="cpu", engine=EngineConfig(num_kv_blocks=32))
    transfer = TransferConfig(lease_s=5.0, max_message_bytes=1 << 20, staging_bytes=4 << 20)
    built = [traced(PrefillReplica("prefill-0", spec, transfer), spans),
             traced(DecodeReplica("decode-0", spec, transfer), spans),
             traced(DecodeReplica("colocated-0", spec, None), spans)]
    yield built
    for replica in built:
        asyncio.run(replica.shutdown())


def traceparent() -> tuple[str, int, int]:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", int(trace_id, 16), int(span_id, 16)


def call_span(spans: InMemorySpanExporter, name: str, trace_id: int):
    """The one span `name` of trace trace_id, and its children in time order."""
    finished = [s for s in spans.get_finished_spans() if s.context.trace_id == trace_id]
    [span] = [s for s in finished if s.name == name]
    children = sorted((s for s in finished if s.parent is not None and s.parent.span_id == span.context.span_id),
                      key=lambda s: s.start_time)
    return span, children


def check_tiles(span, children, phases: list[str]) -> None:
    assert [c.name for c in children] == phases
    assert children[0].start_time == span.start_time and children[-1].end_time == span.end_time
    for before, after in zip(children, children[1:]):
        assert before.end_time == after.start_time, (before.name, after.name)


def test_a_disaggregated_request_writes_a_prefill_and_a_decode_span_under_the_routers(replicas, spans, tiny_llama):
    prefill, decode, _ = replicas
    header, trace_id, parent_id = traceparent()
    prompt = tiny_llama.tokenizer.encode("The quick brown fox jumps over the lazy dog " * 3)

    async def run():
        info = await prefill.ready()
        descriptor = await decode.reserve("d1", prompt, PARAMS, senders=info.kv_addresses)
        result = await prefill.prefill("d1", prompt, PARAMS, descriptor, trace=header)
        return result, [t async for batch in decode.decode("d1", result.first_token, trace=header)
                        for out in batch for t in out.token_ids]

    result, tokens = asyncio.run(run())
    assert len(tokens) == TOKENS
    span, children = call_span(spans, "prefill_replica", trace_id)
    assert span.parent.span_id == parent_id and span.status.is_ok
    check_tiles(span, children, ["queue", "compute", "kv_send"])
    # the queue the replica tells the router (its metrics' prefill queue) is the one its span shows
    queue = (children[0].end_time - children[0].start_time) / 1e9
    assert 0 < result.queue_s <= queue
    assert span.attributes["tandem.request_id"] == "d1" and span.attributes["tandem.replica"] == "prefill-0"
    assert span.attributes["gen_ai.usage.input_tokens"] == len(prompt)
    assert span.resource.attributes["tandem.component"] == "prefill"
    span, children = call_span(spans, "decode_replica", trace_id)
    assert span.parent.span_id == parent_id and span.status.is_ok
    check_tiles(span, children, ["kv_wait", "admission", "decode"])
    assert span.attributes["gen_ai.usage.output_tokens"] == TOKENS
    assert span.resource.attributes["service.instance.id"] == "decode-0"


def test_a_request_prefilled_where_it_decodes_splits_its_queue_from_its_prefill(replicas, spans, tiny_llama):
    _, _, colocated = replicas
    header, trace_id, parent_id = traceparent()
    prompt = tiny_llama.tokenizer.encode("Once upon a time, in a land far away, there lived")

    async def run() -> int:
        return sum([len(out.token_ids) async for batch in colocated.generate("g1", prompt, PARAMS, trace=header)
                    for out in batch])

    assert asyncio.run(run()) == TOKENS
    span, children = call_span(spans, "decode_replica", trace_id)
    assert span.parent.span_id == parent_id and span.attributes["tandem.status"] == "OK"
    check_tiles(span, children, ["queue", "prefill", "decode"])
    assert span.attributes["gen_ai.usage.output_tokens"] == TOKENS


def test_a_refused_call_writes_its_span_with_the_reason(replicas, spans):
    _, _, colocated = replicas
    header, trace_id, _ = traceparent()
    too_long = list(range(600))  # past the tiny model's context

    async def run() -> None:
        async for _ in colocated.generate("g2", too_long, PARAMS, trace=header):
            pass

    with pytest.raises(ValueError):
        asyncio.run(run())
    span, children = call_span(spans, "decode_replica", trace_id)
    assert not span.status.is_ok and span.attributes["tandem.status"] in ("ValueError", "RequestRejectedError")
    assert children == []


def test_an_untraced_call_writes_nothing_and_no_endpoint_means_no_tracer(replicas, spans, tiny_llama):
    _, _, colocated = replicas
    before = len(spans.get_finished_spans())

    async def run() -> int:
        return sum([len(out.token_ids) async for batch in colocated.generate("g3", [1, 2, 3], PARAMS)
                    for out in batch])

    assert asyncio.run(run()) == TOKENS
    assert len(spans.get_finished_spans()) == before
    spec = ReplicaSpec(model=str(tiny_llama.source), device="cpu", engine=EngineConfig(num_kv_blocks=8))
    for tracing in (None, TracingConfig(None)):
        replica = DecodeReplica("untraced-0", spec, None, tracing=tracing)
        try:
            assert replica.tracer is None
        finally:
            asyncio.run(replica.shutdown())
