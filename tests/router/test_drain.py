"""Draining a router (router/serving.py Serving.drain, what SIGTERM to `tandem up` and `tandem down --drain` run):
/health turns 503 "draining" first, new requests get 503 with Retry-After (gRPC: UNAVAILABLE with a retry-after
trailer), running ones finish. A rolling replacement under load loses no request: a second router beside the
first takes the traffic while the first drains. Real uvicorn and gRPC servers over mock replicas on loopback;
tests/cluster/test_cli_lifecycle.py drains a real cluster with `tandem down --drain`."""

from __future__ import annotations

import threading
import time

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.proto.v1 import tandem_pb2_grpc
from tandem.router.client import build_request
from tandem.router.driver_settings import DriverSettings
from tandem.router.grpc_service import LIVENESS, TandemServicer, drain_health, start_grpc_server
from tandem.router.http_service import build_app, start_http_server
from tandem.router.lifecycle import RequestDriver
from tandem.router.mocks.replicas import MockDecode, MockPrefill
from tandem.router.replicas import Replica
from tandem.router.serving import Draining, Serving, error_code
from tests.router.router_harness import MODEL, BackgroundLoop, model_facts

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
STEP_S = 0.01  # a mock decode step: a 32-token request runs for about 0.3 s
TOKENS = 32


class Router:
    """One router's serving core and HTTP server over the shared mock replicas, on the shared loop."""

    def __init__(self, loop: BackgroundLoop, prefill: MockPrefill, decode: MockDecode):
        async def boot():
            settings = DriverSettings()
            driver = RequestDriver([Replica(prefill.name, "prefill", prefill)],
                                   [Replica(decode.name, "decode", decode)], settings)
            serving = Serving(driver, model_facts(), settings.mode)
            http, port = await start_http_server(build_app(serving), "127.0.0.1:0")
            return serving, http, port

        self.loop = loop
        self.serving, self.http, port = loop.run(boot())
        self.url = f"http://127.0.0.1:{port}"

    def drain(self, timeout_s: float) -> int:
        return self.loop.run(self.serving.drain(timeout_s), timeout_s + 10)

    def stop(self) -> None:
        self.loop.run(self.http.stop())


@pytest.fixture
def routers():
    loop = BackgroundLoop()
    prefill, decode = MockPrefill("prefill-0"), MockDecode("decode-0", step_s=STEP_S)
    made = [Router(loop, prefill, decode), Router(loop, prefill, decode)]
    yield made
    for router in made:
        router.stop()
    loop.stop()


def completion(url: str, prompt: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=30,
                      json={"model": MODEL, "prompt": prompt, "max_tokens": TOKENS, "ignore_eos": True})


class Balancer:
    """What a load balancer does in front of two routers: it sends to the routers whose /health said 200 when it
    last looked (every 50 ms), and sends a request refused with 503 + Retry-After, or whose connection was refused
    (a router gone before the balancer's next look), to another: neither was taken by anyone."""

    def __init__(self, urls: list[str]):
        self.urls, self.healthy = urls, list(urls)
        self.refused: list[httpx.Response] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.is_set():
            self.healthy = [u for u in self.urls if _health(u) == 200] or self.healthy
            time.sleep(0.05)

    def send(self, prompt: str, turn: int) -> httpx.Response:
        for attempt in range(len(self.urls)):
            urls = self.healthy
            try:
                reply = completion(urls[(turn + attempt) % len(urls)], prompt)
            except httpx.ConnectError:  # nothing was sent: safe to send elsewhere, as load balancers do
                if attempt == len(self.urls) - 1:
                    raise
                time.sleep(0.06)
                continue
            if reply.status_code != 503:
                return reply
            self.refused.append(reply)
            time.sleep(0.06)  # the next health poll moves away from a draining router
        return reply

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


def _health(url: str) -> int:
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code
    except httpx.HTTPError:
        return 0


def test_a_rolling_replacement_under_load_loses_no_request(routers):
    old, new = routers
    old_only = Balancer([old.url])
    clients, replies, errors = 6, [], []
    stop = threading.Event()

    def client(index: int, balancer_box: list) -> None:
        turn = 0
        while not stop.is_set():
            prompt = f"client {index} turn {turn}"
            try:
                replies.append((prompt, balancer_box[0].send(prompt, turn + index)))
            except Exception as e:  # a connection error: a lost request
                errors.append(repr(e))
            turn += 1

    box = [old_only]
    threads = [threading.Thread(target=client, args=(i, box)) for i in range(clients)]
    for thread in threads:
        thread.start()
    time.sleep(1.0)  # steady load on the old router alone
    both = Balancer([old.url, new.url])  # the new release is up beside it: the balancer sends to both
    box[0] = both
    time.sleep(0.5)
    running = len(old.serving.active)
    draining = threading.Thread(target=lambda: drained.append(old.drain(20)))
    drained: list[int] = []
    draining.start()
    deadline = time.monotonic() + 5
    while not old.serving.draining and time.monotonic() < deadline:
        time.sleep(0.005)
    assert _health(old.url) == 503 and httpx.get(f"{old.url}/health").json()["status"] == "draining"
    refused = completion(old.url, "late")  # a client that missed the health change
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1", refused.text
    assert "draining" in refused.json()["error"]["message"]
    draining.join(30)
    old.stop()  # drained: the old release goes
    time.sleep(1.0)  # load on the new router alone
    stop.set()
    for thread in threads:
        thread.join(30)
    old_only.close()
    both.close()

    assert running > 0 and drained == [0]  # requests were running on the old router when it began to drain
    assert not errors, errors[:3]
    assert len(replies) > 3 * clients
    failed = [(prompt, r.status_code, r.text) for prompt, r in replies if r.status_code != 200]
    assert not failed, failed[:3]
    for prompt, reply in replies:
        choice = reply.json()["choices"][0]
        assert choice["finish_reason"] == "length" and reply.json()["usage"]["completion_tokens"] == TOKENS
    assert all(r.headers.get("retry-after") == "1" for r in both.refused)
    assert new.serving.num_finished > 0 and old.serving.num_failed == 1 + len(both.refused)


def test_a_drain_that_times_out_says_how_many_requests_were_still_running(routers):
    router = routers[0]
    reply: list[httpx.Response] = []
    long = threading.Thread(target=lambda: reply.append(httpx.post(
        f"{router.url}/v1/completions", timeout=30,
        json={"model": MODEL, "prompt": "long", "max_tokens": 200, "ignore_eos": True})))
    long.start()
    deadline = time.monotonic() + 10
    while not router.serving.active and time.monotonic() < deadline:
        time.sleep(0.01)
    assert router.drain(0.2) == 1  # 200 steps of 10 ms outlast a 0.2 s drain
    long.join(30)
    assert reply[0].status_code == 200  # drain itself ends nothing: stopping the router does


def test_grpc_refuses_new_requests_with_unavailable_and_a_retry_after_while_draining():
    loop = BackgroundLoop()

    async def boot():
        driver = RequestDriver([], [Replica("decode-0", "decode", MockDecode("decode-0"))], DriverSettings())
        serving = Serving(driver, model_facts(), "colocated")
        server, port, health = await start_grpc_server(TandemServicer(serving), "127.0.0.1:0")
        return serving, server, port, health

    serving, server, port, health = loop.run(boot())
    try:
        loop.run(serving.drain(1.0))
        loop.run(drain_health(health))  # what RouterActor.drain does beside it
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = tandem_pb2_grpc.TandemStub(channel)
            call = stub.Generate(build_request(prompt="Hi", max_tokens=4))
            with pytest.raises(grpc.RpcError) as refused:
                list(call)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "draining" in refused.value.details()
        assert dict(refused.value.trailing_metadata())["retry-after"] == "1"
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            check = health_pb2_grpc.HealthStub(channel).Check
            status = {name: check(health_pb2.HealthCheckRequest(service=name)).status
                      for name in ("", "tandem.v1.Tandem", LIVENESS)}
        assert status == {"": NOT_SERVING, "tandem.v1.Tandem": NOT_SERVING, LIVENESS: SERVING}
    finally:
        loop.run(server.stop(0))
        loop.stop()


def test_draining_refuses_before_any_work_and_counts_the_refusal():
    """Both admission points refuse once the drain began: the front doors' check and run() (a request parsed
    just before), and no replica sees the request."""
    loop = BackgroundLoop()
    decode = MockDecode("decode-0")

    async def check():
        serving = Serving(RequestDriver([], [Replica("decode-0", "decode", decode)], DriverSettings()), model_facts(),
                          "colocated")
        parsed = await serving.parse(build_request(prompt="Hi", max_tokens=2), None, "grpc")
        assert await serving.drain(1.0) == 0  # nothing running: drained at once
        with pytest.raises(Draining) as refused:
            serving.check_capacity(1, "http")
        assert error_code(refused.value)[0] == "UNAVAILABLE"
        with pytest.raises(Draining):
            async for _ in serving.run(parsed, time.monotonic(), "grpc"):
                pass
        return serving.num_failed

    try:
        assert loop.run(check()) == 2
        assert decode.served == []
    finally:
        loop.stop()
