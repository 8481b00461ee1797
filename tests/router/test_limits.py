"""Bounded requests and isolated tenants at the router's two front doors, over the mock replicas: every request
limit refused before any work with the right status on both APIs (and the server serving on), parsing off the
event loop, deadlines that abort a request everywhere, request ids scoped by tenant, priority ranges, and
per-tenant caps that answer 429 + Retry-After without slowing other tenants."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import grpc
import httpx
import pytest

from tandem.proto.v1 import tandem_pb2 as pb
from tandem.proto.v1 import tandem_pb2_grpc as pb_grpc
from tandem.router.auth import Authenticator
from tandem.router.client import build_request
from tandem.router.grpc_service import TandemServicer, start_grpc_server
from tandem.router.http_service import build_app, start_http_server
from tandem.router.driver_settings import DriverSettings
from tandem.router.lifecycle import RequestDriver
from tandem.router.limits import PriorityRange, RequestLimits, ServingLimits, TenantLimits
from tandem.router.mocks.replicas import MockDecode
from tandem.router.replicas import Replica
from tandem.router.serving import Serving

from tests.router.router_harness import MODEL, BackgroundLoop, embedded, model_facts

KEYS = {"sk-acme-0123456789": "acme", "sk-beta-0123456789": "beta"}
ACME, BETA = ({"authorization": "Bearer sk-acme-0123456789"}, {"authorization": "Bearer sk-beta-0123456789"})
LIMITS = RequestLimits(max_body_bytes=64 << 10, max_prompt_chars=20_000, max_n=4, max_tokens=64,
                       max_stop_strings=2, max_stop_string_chars=8, max_top_logprobs=5, max_batch_prompts=3,
                       max_messages=4, max_stop_token_ids=3)


class PriorityDecode(MockDecode):
    """A mock decode replica that records the priority and tenant each request reached it with, and keeps the
    streams of the tenants in `holding` at their first token until the test empties it (a cap test's holders stay
    admitted for as long as the test needs, however slow the machine)."""

    def __init__(self, name: str, **kwargs):
        super().__init__(name, **kwargs)
        self.priorities: dict[str, int] = {}
        self.tenants: dict[str, str | None] = {}
        self.holding: set[str] = set()

    def generate(self, request_id, prompt_token_ids, params, *, priority=0, cache_salt=None, tenant=None,
                 trace=None):
        self.priorities[request_id] = priority
        self.tenants[request_id] = tenant
        return super().generate(request_id, prompt_token_ids, params, priority=priority, cache_salt=cache_salt,
                                tenant=tenant, trace=trace)

    async def _stream(self, request_id, *args, **kwargs):
        while request_id.partition("/")[0] in self.holding:
            await asyncio.sleep(0.005)
        async for batch in super()._stream(request_id, *args, **kwargs):
            yield batch


class Front(BackgroundLoop):
    """Serving over one mock decode replica (colocated), both APIs on free loopback ports, on a background loop."""

    def __init__(self, limits: ServingLimits, *, step_s: float = 0.0, keys=KEYS):
        super().__init__()
        self.decode = PriorityDecode("decode-0", step_s=step_s)
        self.tokenizer = embedded().tokenizer
        facts = model_facts()

        async def boot():
            settings = DriverSettings(mode="colocated")
            driver = RequestDriver([], [Replica("decode-0", "decode", self.decode)], settings)
            self.serving = Serving(driver, facts, "colocated", auth=Authenticator(keys), limits=limits)
            self.http, http_port = await start_http_server(build_app(self.serving), "127.0.0.1:0")
            self.grpc, grpc_port, _ = await start_grpc_server(TandemServicer(self.serving), "127.0.0.1:0",
                                                              max_message_bytes=limits.limits.max_body_bytes)
            return http_port, grpc_port

        http_port, grpc_port = self.run(boot())
        self.url = f"http://127.0.0.1:{http_port}"
        self.target = f"127.0.0.1:{grpc_port}"
        self.channel = grpc.insecure_channel(self.target)
        self.stub = pb_grpc.TandemStub(self.channel)

    def chat(self, headers=ACME, **body) -> httpx.Response:
        """body: the chat body's fields (`timeout` among them: the request's own deadline, in seconds)."""
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2} | body
        return httpx.post(f"{self.url}/v1/chat/completions", json=body, headers=headers, timeout=30)

    def generate(self, metadata=ACME, timeout=30, **kwargs) -> list[pb.GenerateResponse]:
        """One call on a channel of its own, so one test's streams never share a channel with the next test's.
        The failures this module met only in full-suite runs were the suite process's own: a full garbage
        collection held the GIL for seconds (tests/conftest.py freezes each file's survivors against it)."""
        kwargs = {"prompt": "Hi", "max_tokens": 2} | kwargs
        with grpc.insecure_channel(self.target) as channel:
            stub = pb_grpc.TandemStub(channel)
            return list(stub.Generate(build_request(**kwargs), metadata=tuple(metadata.items()), timeout=timeout))

    def held(self) -> dict:
        return dict(self.serving.gate.held)

    def close(self) -> None:
        self.channel.close()

        async def stop():
            await self.http.stop()
            await self.grpc.stop(1)
            self.serving.close()

        self.run(stop())
        super().stop()


@pytest.fixture(scope="module")
def front():
    tenants = {"acme": TenantLimits(priority=PriorityRange(min=-5, max=5), max_requests=2, retry_after_s=3)}
    # request_timeout_s: far past what any request here takes (the deadline tests set their own), so that a slow
    # machine never turns a held request into a 504.
    f = Front(ServingLimits(limits=LIMITS, tenants=tenants, request_timeout_s=30.0), step_s=0.02)
    yield f
    f.close()


def aborted(front: Front) -> set[str]:
    """The ids the replica was told to abort, as the router scopes them (tenant/id), without the run number."""
    return {rid.rpartition("/")[0] for rid in front.decode.aborted}


def _served_normally(front: Front) -> None:
    assert front.chat().json()["choices"][0]["finish_reason"] == "length"
    assert front.generate()[-1].finish_reason == "length"


HTTP_REFUSALS = {
    "n": ({"n": 5}, "n=5 is more than this server allows (4)"),
    "max_tokens": ({"max_tokens": 65}, "max_tokens=65 is more than this server allows: 64"),
    "stop count": ({"stop": ["a", "b", "c"]}, "3 stop strings; this server takes at most 2"),
    "stop length": ({"stop": ["x" * 9]}, "a stop string of 9 characters"),
    "stop token ids": ({"stop_token_ids": [1, 2, 3, 4]}, "4 stop_token_ids"),
    "top_logprobs": ({"logprobs": True, "top_logprobs": 6}, "logprobs=6 asks for more alternatives"),
    "messages": ({"messages": [{"role": "user", "content": "a"}] * 5}, "messages holds 5 messages"),
    "prompt chars": ({"messages": [{"role": "user", "content": "x" * 20_001}]}, "the prompt has 20001 characters"),
    "prompt tokens": ({"messages": [{"role": "user", "content": "hello " * 600}], "max_tokens": 1},
                      "this server takes at most 512"),
    "timeout": ({"timeout": -1}, "timeout"),
}


@pytest.mark.parametrize("name", HTTP_REFUSALS)
def test_each_http_limit_is_a_400_before_any_work_and_the_server_serves_on(front, name):
    body, needle = HTTP_REFUSALS[name]
    served = len(front.decode.served)
    reply = front.chat(**body)
    assert reply.status_code == 400, reply.text
    assert needle in reply.json()["error"]["message"]
    assert len(front.decode.served) == served  # no replica saw it
    _served_normally(front)


def test_completion_batches_are_bounded(front):
    body = {"model": MODEL, "prompt": ["a", "b", "c", "d"], "max_tokens": 1}
    reply = httpx.post(f"{front.url}/v1/completions", json=body, headers=ACME)
    assert reply.status_code == 400 and "batch of 4 prompts" in reply.json()["error"]["message"]
    body["prompt"] = ["a", "b", "c"]  # three requests: beta has no cap (acme's is 2: a 429)
    assert httpx.post(f"{front.url}/v1/completions", json=body, headers=ACME).status_code == 429
    assert len(httpx.post(f"{front.url}/v1/completions", json=body, headers=BETA).json()["choices"]) == 3


@pytest.mark.parametrize("how", ["content-length", "chunked"])
def test_a_body_over_the_limit_is_a_413(front, how):
    big = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x" * (70 << 10)}]}).encode()
    content = big if how == "content-length" else iter([big[i:i + 8192] for i in range(0, len(big), 8192)])
    reply = httpx.post(f"{front.url}/v1/chat/completions", content=content,
                       headers=ACME | {"content-type": "application/json"})
    assert reply.status_code == 413 and "max_body_bytes" in reply.json()["error"]["message"]
    _served_normally(front)


def _raw_reply(front: Front, head: bytes, body: bytes) -> bytes:
    """What the server answers a request sent whole over a plain socket, read until it closes."""
    import socket

    host, port = front.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        try:
            sock.sendall(head + body)
        except OSError:  # the server answered and closed before taking everything
            pass
        reply = b""
        try:
            while chunk := sock.recv(65536):
                reply += chunk
        except ConnectionResetError:
            pass
    return reply


def test_the_413_reaches_a_client_still_sending_its_body(front):
    # A body 12 MiB over the limit, sent whole: the server reads it to its end before answering, so that
    # closing the connection does not reset it and destroy the 413 on its way (without that, this fails).
    body = b'{"model": "m", "prompt": "' + b"x" * (12 << 20) + b'"}'
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + ACME["authorization"].removeprefix("Bearer ").encode()
            + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n")
    for _ in range(10):
        reply = _raw_reply(front, head, body)
        assert reply.startswith(b"HTTP/1.1 413") and b"max_body_bytes" in reply, reply[:300]
    # A declared length past what is worth reading is answered at once, from the headers alone.
    head = head.replace(str(len(body)).encode(), str(1 << 40).encode())
    reply = _raw_reply(front, head, b"")
    assert reply.startswith(b"HTTP/1.1 413") and b"max_body_bytes" in reply, reply[:300]
    _served_normally(front)


def test_a_client_that_stalls_mid_body_is_let_go_after_the_body_timeout():
    import socket

    f = Front(ServingLimits(limits=RequestLimits(body_timeout_s=0.5)), keys=None)
    try:
        host, port = f.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{\"model\": ")
            reply = b""  # nothing more is sent; the reply's head and body may come in separate reads
            while b"body_timeout_s" not in reply and (chunk := sock.recv(65536)):
                reply += chunk
        assert reply.startswith(b"HTTP/1.1 408") and b"body_timeout_s" in reply
        assert httpx.get(f"{f.url}/nowhere").json()["error"]["message"] == "Not Found"  # OpenAI's error shape
        assert f.chat({}).status_code == 200
    finally:
        f.close()


@pytest.mark.parametrize("raw, needle", [
    (b"[" * 30_000 + b"]" * 30_000, "nests deeper than 32"),  # past the JSON decoder's recursion limit
    (("{\"model\": \"m\", \"messages\": " + "[" * 40 + "]" * 40 + "}").encode(), "nests deeper than 32"),
    (b'{"model": "\xff\xfe"}', "not valid JSON"),
    (b'{"model": ', "not valid JSON"),
])
def test_deep_truncated_or_invalid_json_is_a_400_not_a_500(front, raw, needle):
    reply = httpx.post(f"{front.url}/v1/chat/completions", content=raw,
                       headers=ACME | {"content-type": "application/json"})
    assert reply.status_code == 400 and needle in reply.json()["error"]["message"]
    _served_normally(front)


@pytest.mark.parametrize("kwargs, needle", [
    ({"n": 2_147_483_647}, "n=2147483647 is more than this server allows"),
    ({"max_tokens": 65}, "max_tokens=65"),
    ({"stop": ["a", "b", "c"]}, "3 stop strings"),
    ({"logprobs": 6}, "logprobs=6"),
    ({"chat": [{"role": "user", "content": "a"}] * 5, "prompt": None}, "chat has 5 messages"),
    ({"prompt": "x" * 20_001}, "20001 characters"),
    ({"prompt": None, "token_ids": [1] * 600}, "the prompt has 600 tokens"),
])
def test_grpc_gets_the_same_limits(front, kwargs, needle):
    with pytest.raises(grpc.RpcError) as caught:
        front.generate(**kwargs)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and needle in caught.value.details()
    _served_normally(front)


def test_a_grpc_message_over_the_body_limit_is_refused_by_grpc(front):
    with pytest.raises(grpc.RpcError) as caught:
        front.generate(prompt="x" * (70 << 10))
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    _served_normally(front)


def test_the_same_request_id_in_two_tenants_is_two_requests_and_abort_reaches_only_its_own(front):
    def stream(metadata, out):
        try:
            out.extend(front.generate(metadata, request_id="shared", max_tokens=40, ignore_eos=True))
        except grpc.RpcError as e:
            out.append(e.code())

    acme, beta = [], []
    threads = [threading.Thread(target=stream, args=(ACME, acme)), threading.Thread(target=stream, args=(BETA, beta))]
    front.decode.holding |= {"acme", "beta"}  # both stay at the replica until beta's abort has been sent
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while len(front.serving.active) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert {(k.tenant, k.request_id) for k in front.serving.active} == {("acme", "shared"), ("beta", "shared")}
        assert not front.stub.Abort(pb.AbortRequest(request_id="nobody-has-this"),
                                    metadata=tuple(BETA.items())).found
        assert front.stub.Abort(pb.AbortRequest(request_id="shared"), metadata=tuple(BETA.items())).found
    finally:
        front.decode.holding.clear()
    for t in threads:
        t.join(30)
    assert beta == [grpc.StatusCode.CANCELLED]  # beta aborted its own request ...
    assert acme[-1].finish_reason == "length" and all(m.request_id == "shared" for m in acme)  # ... not acme's
    served = {rid.rpartition("/")[0] for rid in front.decode.served}
    assert {"acme/shared", "beta/shared"} <= served  # the replicas never mixed them up
    assert "beta/shared" in {rid.rpartition("/")[0] for rid in front.decode.aborted}


def test_priorities_are_clamped_to_the_tenants_range(front):
    for metadata, asked, expected in [(ACME, -100, -5), (ACME, 3, 3), (ACME, 99, 5), (BETA, -100, 0), (BETA, 7, 0)]:
        rid = f"prio-{asked}-{expected}-{metadata is ACME}"
        front.generate(metadata, request_id=rid, priority=asked)
        tenant = "acme" if metadata is ACME else "beta"
        seen = {k.rpartition("/")[0]: v for k, v in front.decode.priorities.items()}
        assert seen[f"{tenant}/{rid}"] == expected
        # and the tenant reaches the replica, whose scheduler shares by it (a pool's scheduler.policy: fair)
        assert {k.rpartition("/")[0]: v for k, v in front.decode.tenants.items()}[f"{tenant}/{rid}"] == tenant


def test_a_tenant_past_its_cap_gets_429_with_retry_after_and_others_are_not_slowed(front):
    # acme may hold 2 requests; two held at the replica until the checks are done hold them.
    replies = []
    holders = [threading.Thread(target=lambda: replies.append(front.chat(max_tokens=60, ignore_eos=True)))
               for _ in range(2)]
    front.decode.holding.add("acme")
    try:
        for t in holders:
            t.start()
        deadline = time.monotonic() + 10
        while front.held().get("acme", 0) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert front.held() == {"acme": 2}, "the two holders were not both admitted within 10 s"
        _refused_past_the_cap(front)
    finally:
        front.decode.holding.clear()
    for t in holders:
        t.join(30)
    assert [r.status_code for r in replies] == [200, 200]
    assert front.held() == {}
    assert front.chat().status_code == 200


def _refused_past_the_cap(front: Front) -> None:
    refused = front.chat()
    assert refused.status_code == 429 and refused.headers["retry-after"] == "3"
    assert refused.json()["error"]["type"] == "rate_limit_error"
    with pytest.raises(grpc.RpcError) as caught:
        front.generate()
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert ("grpc-retry-pushback-ms", "3000") in caught.value.trailing_metadata()
    start = time.monotonic()
    assert front.chat(BETA).status_code == 200  # another tenant is let in at once, served at the usual pace
    assert time.monotonic() - start < 1.0  # 2 tokens at 20 ms a step, while acme's requests are held


def test_an_aborted_id_can_be_used_again_once_its_request_ended(front):
    """Replicas remember aborted ids for a while; each run of an id is a new request to them."""
    front.decode.holding.add("acme")  # the request stays at the replica until its abort has been sent
    try:
        call = front.stub.Generate(build_request(prompt="Hi", request_id="again", max_tokens=40, ignore_eos=True),
                                   metadata=tuple(ACME.items()))
        deadline = time.monotonic() + 10
        while ("acme", "again") not in {(k.tenant, k.request_id) for k in front.serving.active}:
            assert time.monotonic() < deadline, "the request never became active"
            time.sleep(0.01)
        assert front.stub.Abort(pb.AbortRequest(request_id="again"), metadata=tuple(ACME.items())).found
    finally:
        front.decode.holding.clear()
    with pytest.raises(grpc.RpcError) as caught:
        list(call)
    assert caught.value.code() == grpc.StatusCode.CANCELLED
    assert front.generate(request_id="again")[-1].finish_reason == "length"


def test_undecodable_grpc_bytes_are_invalid_argument_not_unknown(front):
    for raw in (b"\x80", b"*\x08\n\x06\n\x04\x80abc"):  # corrupt wire format; bad UTF-8 in a chat role
        generate = front.channel.unary_stream("/tandem.v1.Tandem/Generate", request_serializer=lambda b: b,
                                              response_deserializer=lambda b: b)
        with pytest.raises(grpc.RpcError) as caught:
            list(generate(raw, metadata=tuple(ACME.items())))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not a valid tandem.v1.GenerateRequest" in caught.value.details()
    _served_normally(front)


def test_a_deadline_aborts_the_request_everywhere_with_504_or_deadline_exceeded(front):
    reply = front.chat(max_tokens=60, ignore_eos=True, timeout=0.3)  # body field: seconds
    assert reply.status_code == 504 and reply.json()["error"]["type"] == "timeout_error"
    assert "deadline" in reply.json()["error"]["message"]
    with pytest.raises(grpc.RpcError) as caught:  # the client's own gRPC deadline
        front.generate(timeout=0.3, max_tokens=60, ignore_eos=True, request_id="late")
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    deadline = time.monotonic() + 5
    while not ("acme/late" in aborted(front) and front.held() == {} and front.decode.running == 0):
        assert time.monotonic() < deadline, (aborted(front), front.held(), front.decode.running)
        time.sleep(0.01)


def test_the_manifest_deadline_applies_when_the_client_sets_none():
    f = Front(ServingLimits(request_timeout_s=2.0), step_s=0.02, keys=None)
    f.decode.holding.add("slow")  # held at the replica until the deadline (no tenant: the replica's id is slow/run)
    try:
        with pytest.raises(grpc.RpcError) as caught:
            f.generate({}, request_id="slow", max_tokens=60, ignore_eos=True)
        assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED  # the client set no deadline of its own
        assert "slow" in aborted(f)
        f.decode.holding.clear()
        assert f.generate({})[-1].finish_reason == "length"
    finally:
        f.close()


def test_a_maximal_prompt_is_parsed_off_the_event_loop_without_delaying_other_streams():
    """A prompt at the character limit takes the tokenizer about a second on this machine; another request's
    tokens keep flowing meanwhile (the same tokenizing on the event loop would stall them all that long)."""
    chars = 1_200_000
    f = Front(ServingLimits(limits=RequestLimits(max_prompt_chars=chars, max_body_bytes=2 << 20)), step_s=0.01,
              keys=None)
    try:
        text = "hello world, this is a test of the tokenizer. " * (chars // 46)
        start = time.perf_counter()
        f.tokenizer.encode(text)
        tokenize_s = time.perf_counter() - start
        arrivals: list[float] = []
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 150,
                "ignore_eos": True, "stream": True}

        def stream():
            with httpx.stream("POST", f"{f.url}/v1/chat/completions", json=body, timeout=30) as reply:
                for line in reply.iter_lines():
                    if line.startswith("data: {"):
                        arrivals.append(time.perf_counter())

        streamer = threading.Thread(target=stream)
        streamer.start()
        while len(arrivals) < 10:
            time.sleep(0.005)
        parsed_at = time.perf_counter()
        big = f.chat({}, messages=[{"role": "user", "content": text}], max_tokens=1)  # over 512 tokens: 400
        parse_s = time.perf_counter() - parsed_at
        streamer.join(30)
        assert big.status_code == 400 and "tokens" in big.json()["error"]["message"]
        during = [b - a for a, b in zip(arrivals, arrivals[1:]) if parsed_at <= b <= parsed_at + parse_s]
        assert parse_s > 0.5 * tokenize_s and len(during) > 5  # the stream went on while the prompt was parsed
        assert max(during) < max(0.25, tokenize_s / 3), (max(during), tokenize_s)
    finally:
        f.close()
