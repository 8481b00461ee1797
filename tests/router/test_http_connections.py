"""The HTTP front door's connection guards (router/http_connections.py): a client that sends its headers slowly,
or nothing, is answered 408 and dropped after router.limits.body_timeout_s, on a new connection and on a kept-alive
one; one client address holds at most router.limits.max_connections_per_client connections (more get 429 and are
closed) while other requests are served throughout. A real uvicorn server over a mock replica on loopback."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from tandem.router.driver_settings import DriverSettings
from tandem.router.http_service import build_app, start_http_server
from tandem.router.lifecycle import RequestDriver
from tandem.router.limits import RequestLimits, ServingLimits
from tandem.router.mocks.replicas import MockDecode
from tandem.router.replicas import Replica
from tandem.router.serving import Serving
from tests.router.router_harness import MODEL, BackgroundLoop, model_facts

TIMEOUT_S = 0.6
CAP = 3


@pytest.fixture(scope="module")
def server():
    loop = BackgroundLoop()

    async def boot():
        settings = DriverSettings(mode="colocated")
        driver = RequestDriver([], [Replica("decode-0", "decode", MockDecode("decode-0"))], settings)
        limits = ServingLimits(limits=RequestLimits(body_timeout_s=TIMEOUT_S, max_connections_per_client=CAP))
        serving = Serving(driver, model_facts(), "colocated", limits=limits)
        return await start_http_server(build_app(serving), "127.0.0.1:0")

    http, port = loop.run(boot())
    yield port
    loop.run(http.stop())
    loop.stop()


def connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    return sock


def read_reply(sock: socket.socket) -> tuple[int, dict, float]:
    """(status, JSON body, seconds waited) of the one reply the server sends before it closes the connection."""
    start, data = time.monotonic(), b""
    while chunk := sock.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body), time.monotonic() - start


def completion(port: int) -> httpx.Response:
    return httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=10,
                      json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})


def test_headers_sent_slowly_get_408_and_the_connection_is_dropped(server):
    slow = connect(server)
    slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # and never the rest
    assert completion(server).status_code == 200  # everyone else is served meanwhile
    status, body, waited = read_reply(slow)
    assert status == 408 and body["error"]["code"] == "request_timeout"
    assert "router.limits.body_timeout_s" in body["error"]["message"]
    assert waited < TIMEOUT_S + 2
    slow.close()


def test_a_connection_that_sends_nothing_is_closed_too(server):
    silent = connect(server)
    status, body, waited = read_reply(silent)
    assert status == 408 and waited < TIMEOUT_S + 2
    silent.close()


def test_a_kept_alive_connection_gets_the_same_time_for_its_next_request(server):
    with httpx.Client(base_url=f"http://127.0.0.1:{server}", timeout=10) as client:
        for _ in range(3):  # requests on one kept-alive connection, each well within the timeout
            reply = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
            assert reply.status_code == 200
            time.sleep(TIMEOUT_S / 3)
    sock = connect(server)
    body = json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 2}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    first = b""
    while b"\r\n\r\n" not in first:
        first += sock.recv(65536)
    assert first.startswith(b"HTTP/1.1 200")
    time.sleep(0.2)
    sock.sendall(b"GET /health HTTP/1.1\r\n")  # the second request's headers stall
    start = time.monotonic()
    rest = b""
    while chunk := sock.recv(65536):
        rest += chunk
    assert b"408 Request Timeout" in rest and time.monotonic() - start < TIMEOUT_S + 2
    sock.close()


def test_connections_past_the_cap_per_address_get_429_and_the_cap_frees_as_they_close(server):
    held = [connect(server) for _ in range(CAP)]
    for sock in held:  # each holds its place with a request in progress (headers done, body pending)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n")
    time.sleep(0.1)
    refused = completion(server)
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "too_many_connections"
    assert "router.limits.max_connections_per_client" in refused.json()["error"]["message"]
    for sock in held:
        sock.close()
    deadline = time.monotonic() + 5
    while (reply := completion(server)).status_code == 429 and time.monotonic() < deadline:
        time.sleep(0.05)  # the server sees the closes a moment later
    assert reply.status_code == 200


def test_replies_go_out_at_once_without_waiting_for_the_clients_ack():
    """Every accepted connection has TCP_NODELAY: without it (a listening socket made with proto 0, which asyncio
    does not take for TCP) Nagle's algorithm held each reply on a kept-alive connection for the client's delayed
    ACK, about 40 ms a request."""
    loop = BackgroundLoop()

    async def boot():
        driver = RequestDriver([], [Replica("decode-0", "decode", MockDecode("decode-0"))],
                               DriverSettings(mode="colocated"))
        return await start_http_server(build_app(Serving(driver, model_facts(), "colocated")), "127.0.0.1:0")

    http, port = loop.run(boot())
    try:
        with httpx.Client(timeout=10) as client:
            for _ in range(3):
                assert client.get(f"http://127.0.0.1:{port}/health").status_code == 200

            async def nodelay() -> list[int]:
                return [c.transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
                        for c in http.server.server_state.connections]

            flags = loop.run(nodelay())
        assert flags and all(flags), flags
    finally:
        loop.run(http.stop())
        loop.stop()
