"""The gRPC client (router/client.py) reconnects soon after its router comes back on the same address: the control
plane replaces a dead router within seconds, and gRPC's default reconnect backoff (1 s growing by 1.6x up to
120 s, shared by every channel to the address) would keep a client that called meanwhile away for longer still."""

from __future__ import annotations

import socket
import time
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tandem.router.client import MAX_RECONNECT_BACKOFF_MS, TandemClient

DOWN_S = 6.0  # long enough for gRPC's default backoff to reach 4 s (1 + 1.6 + 2.56 s of waits before it)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_health(port: int) -> grpc.Server:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=[("grpc.so_reuseport", 0)])
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    assert server.add_insecure_port(f"127.0.0.1:{port}") == port
    server.start()
    return server


def test_a_client_that_called_while_its_router_was_down_reconnects_within_its_backoff_bound():
    port = free_port()
    server = serve_health(port)
    with TandemClient(f"127.0.0.1:{port}", timeout_s=5) as client:
        assert client.health() == "SERVING"
        server.stop(grace=None).wait()
        failures = 0
        down_until = time.monotonic() + DOWN_S
        while time.monotonic() < down_until:  # the client keeps calling while nothing listens: backoff grows
            with pytest.raises(grpc.RpcError) as caught:
                client.health()
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
            failures += 1
            time.sleep(0.1)
        assert failures >= 3
        server = serve_health(port)  # the replacement, on the same address
        try:
            back = time.monotonic()
            while True:
                try:
                    assert client.health() == "SERVING"
                    break
                except grpc.RpcError:
                    assert time.monotonic() - back < 30, "the client never reconnected"
                    time.sleep(0.05)
            waited = time.monotonic() - back
        finally:
            server.stop(grace=None)
    # With gRPC's defaults the next attempt after DOWN_S of failures is up to ~4 s away; ours is at most 1 s
    # (+20% jitter) plus the connection itself.
    assert waited < MAX_RECONNECT_BACKOFF_MS / 1000 * 1.2 + 1.0, waited
