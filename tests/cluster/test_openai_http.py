"""The official `openai` client, unchanged, against deploy/manifests/local-parallel.yaml (tp=2 prefill, pp=2 decode, real
UCX, the embedded model) on a simulated multi-node Ray cluster, with API keys for two tenants: chat and
completions, streaming and not, n=2, stop strings, logprobs and usage; greedy outputs equal the gRPC path's;
missing or wrong keys get 401 / UNAUTHENTICATED; two tenants sending the same prompt never share cached blocks;
with conditional disaggregation on, a follow-up turn is prefilled on the decode replica that holds the
conversation, with the same tokens as one process computing it all.
Nothing leaks: every replica is idle and consistent afterwards."""

from __future__ import annotations

import secrets
import time

import grpc
import httpx
import openai
import pytest

from tandem.cluster.manifest import ApiKey, AuthSettings
from tandem.cluster.observability_settings import ObservabilitySettings
from tandem.router.client import TandemClient
from tandem.bench.otlp_collector import OTLPCollector
from tests.cluster.ray_cluster import (QUESTIONS, chat, check_integrity, manifest_for_test, running,
                                      simulated_cluster, wait_idle)

MODEL = "SmolLM2-135M-Instruct"
LOCAL_BELOW = 48
ACME, BETA = "sk-acme-test-0123456789", "sk-beta-test-0123456789"
SYSTEM = ("You are a careful assistant for a library. You answer questions about opening hours, borrowing rules, "
          "late fees and the reading rooms. Keep every answer short and polite, and never invent a rule that is "
          "not written down in the library's handbook.")


@pytest.fixture(scope="module")
def collector():
    c = OTLPCollector()
    yield c
    c.close()


@pytest.fixture(scope="module")
def cluster(collector):
    auth = AuthSettings(api_keys=[ApiKey(tenant="acme", key=ACME), ApiKey(tenant="beta", key=BETA)])
    # every request's trace goes to the test's own OTLP collector
    manifest = manifest_for_test("local-parallel.yaml", auth=auth,
                                 observability=ObservabilitySettings(otlp_endpoint=collector.endpoint))
    # Conditional disaggregation on: a prompt with fewer than 48 uncached tokens on its decode replica is
    # prefilled there (a follow-up turn, a repeated prompt).
    manifest = manifest.model_copy(update={"router": manifest.router.model_copy(
        update={"local_prefill_max_tokens": LOCAL_BELOW})})
    with simulated_cluster():
        with running(manifest) as tandem:
            yield tandem
            wait_idle(tandem)
            check_integrity(tandem)


@pytest.fixture(scope="module")
def client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{cluster.http_endpoint}/v1", api_key=ACME, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def grpc_client(cluster):
    with TandemClient(cluster.endpoint, timeout_s=120, api_key=ACME) as c:
        yield c


def test_greedy_chat_equals_the_grpc_path(client, grpc_client, embedded):
    for question in QUESTIONS[:2]:
        reply = client.chat.completions.create(model=MODEL, messages=chat(question), max_tokens=20, temperature=0)
        via_grpc = grpc_client.generate(chat=chat(question), max_tokens=20, temperature=0)
        assert reply.choices[0].message.content == via_grpc.text
        assert reply.choices[0].finish_reason == via_grpc.finish_reason
        assert reply.usage.prompt_tokens == len(embedded.tokenizer.encode_chat(chat(question)))
        assert reply.usage.completion_tokens == len(via_grpc.token_ids[0])


def test_streaming_chat_streams_the_same_text_and_reports_usage(client):
    messages = chat(QUESTIONS[2])
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    deltas = [ch.choices[0].delta.content for ch in chunks if ch.choices and ch.choices[0].delta.content]
    assert len(deltas) > 3  # incremental, not one block at the end
    assert "".join(deltas) == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # the same prompt, a second time


def test_completions_stop_at_a_stop_string(client):
    prompt = "The three primary colors are"
    free = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0).choices[0]
    words = free.text.split()
    assert len(words) > 3, free.text
    stop = words[2]
    stopped = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                        stop=[stop]).choices[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == free.text[:free.text.index(stop)]


def test_n_samples_with_a_seed(client):
    kwargs = dict(model=MODEL, messages=chat(QUESTIONS[3]), max_tokens=12, temperature=0.9, seed=11, n=2)
    reply = client.chat.completions.create(**kwargs)
    assert [c.index for c in reply.choices] == [0, 1]
    assert all(c.message.content and c.finish_reason for c in reply.choices)
    again = client.chat.completions.create(**kwargs)  # a seed makes sampling repeatable
    assert [c.message.content for c in again.choices] == [c.message.content for c in reply.choices]


def test_logprobs_match_the_grpc_path(client, grpc_client):
    messages = chat(QUESTIONS[0])
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                           logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    via_grpc = grpc_client.generate(chat=messages, max_tokens=6, temperature=0, logprobs=3)
    assert len(content) == len(via_grpc.logprobs[0]) == 6
    for http_lp, grpc_lp in zip(content, via_grpc.logprobs[0]):
        assert http_lp.logprob == pytest.approx(grpc_lp.logprob, abs=1e-4)
        assert len(http_lp.top_logprobs) == 3
        assert http_lp.logprob == pytest.approx(max(t.logprob for t in http_lp.top_logprobs), abs=1e-5)  # greedy


def test_missing_or_wrong_keys_are_refused_on_both_apis(cluster):
    for key in ("sk-wrong-key-0123456789", ""):
        response = httpx.post(f"http://{cluster.http_endpoint}/v1/chat/completions",
                              headers={"Authorization": f"Bearer {key}"} if key else {},
                              json={"model": MODEL, "messages": chat("Hi"), "max_tokens": 2})
        assert response.status_code == 401 and response.json()["error"]["type"] == "authentication_error"
    for key in ("sk-wrong-key-0123456789", None):
        with TandemClient(cluster.endpoint, timeout_s=60, api_key=key) as c:
            with pytest.raises(grpc.RpcError) as caught:
                c.generate(chat=chat("Hi"), max_tokens=2)
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert httpx.get(f"http://{cluster.http_endpoint}/health").status_code == 200  # probes need no key


def test_two_tenants_with_the_same_prompt_do_not_share_blocks(cluster):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "When do you open on Sunday?"}]
    cached = []
    for key in (ACME, ACME, BETA, BETA):
        c = openai.OpenAI(base_url=f"http://{cluster.http_endpoint}/v1", api_key=key, max_retries=0, timeout=120)
        reply = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
        cached.append(reply.usage.prompt_tokens_details.cached_tokens)
    assert cached[0] == 0 and cached[1] >= 48  # acme's second request reuses acme's blocks
    assert cached[2] == 0 and cached[3] >= 48  # beta starts cold although acme cached the same prompt


def test_a_follow_up_turn_is_prefilled_on_the_decode_replica_that_holds_the_conversation(grpc_client, embedded):
    from tandem.engine.core.generator import Generator
    from tandem.engine.sampling_params import SamplingParams

    system = "A conversation that no other test has had. " + SYSTEM  # cold on every replica
    turn1 = [{"role": "system", "content": system}, {"role": "user", "content": "Can I renew a book online?"}]
    first = grpc_client.generate(chat=turn1, max_tokens=12, temperature=0)
    assert first.prefill_route == "prefill_pool"  # a long, cold prompt goes to the prefill pool
    turn2 = turn1 + [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And by phone?"}]
    second = grpc_client.generate(chat=turn2, max_tokens=12, temperature=0)
    # Its blocks sit on the decode replica (transferred there for turn 1): few uncached tokens, prefilled there.
    assert second.prefill_route == "short_prompt" and second.prefill_replica == ""
    assert second.decode_replica == first.decode_replica
    assert second.usage.cached_tokens >= second.usage.prompt_tokens - LOCAL_BELOW
    params = SamplingParams(max_tokens=12, temperature=0)
    with Generator(embedded) as reference:  # the same tokens as one process computing the whole prompt
        want = reference.generate(embedded.tokenizer.encode_chat(turn2), params)
    assert second.token_ids[0] == want.token_ids


def test_metrics_show_requests_and_routing(cluster, client):
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=2)
    text = httpx.get(f"http://{cluster.http_endpoint}/metrics").text
    assert 'tandem_requests_total{api="http",code="OK"}' in text
    assert 'tandem_requests_total{api="grpc",code="OK"}' in text
    assert 'tandem_prefill_decisions_total{reason="prefill_pool",where="prefill_pool"}' in text
    assert 'tandem_prefill_decisions_total{reason="short_prompt",where="decode_replica"}' in text
    assert 'tandem_kv_feed_total{kind="events"}' in text
    # The router actor froze its start-up heap (engine/heap.py): no garbage collection scans it; the collector's
    # pauses and the event loop's lag are on /metrics.
    frozen = next(line for line in text.splitlines() if line.startswith("tandem_gc_frozen_objects "))
    assert float(frozen.split()[1]) > 10_000, frozen
    assert 'tandem_gc_pause_seconds_count{generation="0"}' in text
    assert "tandem_event_loop_lag_seconds_count" in text
    # the replicas' counters come from their stats(), which a scrape asks for: the KV earlier requests moved
    sent = 'tandem_kv_transfer_bytes_total{direction="sent",pool="prefill",'
    deadline = time.monotonic() + 10
    while not any(line.startswith(sent) and float(line.split()[-1]) > 0 for line in text.splitlines()):
        assert time.monotonic() < deadline, [line for line in text.splitlines() if "kv_transfer_bytes" in line]
        time.sleep(0.2)
        text = httpx.get(f"http://{cluster.http_endpoint}/metrics").text


def test_a_request_is_one_trace_in_the_collector_under_the_clients_traceparent(cluster, collector):
    """The router and the replicas send each request's trace to the manifest's collector over OTLP/gRPC: one tree
    under the client's W3C traceparent, the router's phases (the prefill split into the prefill replica's part,
    the KV transfer and the decode replica's admission) tiling the request, which lasts the client's latency
    within 5%, and beside them the prefill and the decode replica's spans of their calls, with their phases."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    # A prompt no cache holds, longer than LOCAL_BELOW: prefilled on the prefill pool, its KV transferred.
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"{trace_id} {SYSTEM} When do you open?"}],
            "max_tokens": 48, "ignore_eos": True}
    with httpx.Client(timeout=120, headers={"Authorization": f"Bearer {ACME}"}) as http:
        warm = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
        assert http.post(f"http://{cluster.http_endpoint}/v1/chat/completions", json=warm).status_code == 200
        sent = time.monotonic()
        reply = http.post(f"http://{cluster.http_endpoint}/v1/chat/completions", json=body,
                          headers={"traceparent": f"00-{trace_id}-{span_id}-01"})
        latency = time.monotonic() - sent
    assert reply.status_code == 200, reply.text
    spans = collector.trace(trace_id, names=("tandem.request", "prefill_replica", "decode_replica"))
    by_id = {span.span_id: span for span in spans}
    [root] = [span for span in spans if span.name == "tandem.request"]
    assert root.parent_span_id.hex() == span_id
    for span in spans:
        assert span is root or span.parent_span_id in by_id, span.name
    # the replicas' spans (their own processes) hang under the root beside the router's phases
    calls = {s.name: s for s in spans if s.parent_span_id == root.span_id and s.name.endswith("_replica")}
    assert sorted(calls) == ["decode_replica", "prefill_replica"]
    components = {span.name: service for service, span in collector.spans_of(trace_id)}
    assert components["prefill_replica"] == "prefill" and components["decode_replica"] == "decode"
    for name, phases in (("prefill_replica", ["queue", "compute", "kv_send"]),
                         ("decode_replica", ["kv_wait", "admission", "decode"])):
        call = calls[name]
        inside = sorted((s for s in spans if s.parent_span_id == call.span_id), key=lambda s: s.start_time_unix_nano)
        assert [s.name for s in inside] == phases, name
        assert root.start_time_unix_nano <= call.start_time_unix_nano <= call.end_time_unix_nano <= \
            root.end_time_unix_nano + 5_000_000, name  # one host's clock; the router's end follows the decode's
    phases = sorted((s for s in spans if s.parent_span_id == root.span_id and s.name not in calls),
                    key=lambda s: s.start_time_unix_nano)
    assert [s.name for s in phases] == ["parse", "admission", "route", "queue", "prefill", "decode"]
    assert sum(s.end_time_unix_nano - s.start_time_unix_nano for s in phases) == \
        root.end_time_unix_nano - root.start_time_unix_nano
    prefill = next(s for s in phases if s.name == "prefill")
    assert {a.key: a.value.string_value for a in prefill.attributes}["tandem.pool"] == "prefill"
    assert sorted(s.name for s in spans if s.parent_span_id == prefill.span_id) == \
        ["decode.admission", "kv_transfer", "prefill.compute", "prefill.queue"]
    duration = (root.end_time_unix_nano - root.start_time_unix_nano) / 1e9
    assert abs(duration - latency) <= 0.05 * latency, (duration, latency)
