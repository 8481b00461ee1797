"""The router's two front doors (gRPC and the OpenAI HTTP API) over one mock decode replica, on free loopback
ports: what `tandem bench`'s tests and bench/loadgen_pacing.py load without a model or Ray. MockFront runs them on
an event loop of its own thread, so a synchronous caller (a test, a script driving asyncio.run) can use them."""

from __future__ import annotations

import asyncio
import threading

from tandem.router.grpc_service import TandemServicer, start_grpc_server
from tandem.router.http_service import build_app, start_http_server
from tandem.router.driver_settings import DriverSettings
from tandem.router.lifecycle import RequestDriver
from tandem.router.replicas import Replica
from tandem.router.request_parsing import ModelFacts
from tandem.router.serving import Serving


class MockFront:
    """Serving (colocated) over `decode` (a router/mocks/replicas.py MockDecode or the like): .target is the
    gRPC HOST:PORT, .url the HTTP API's /v1 root. close() stops both servers and the loop."""

    def __init__(self, decode, facts: ModelFacts, *, timeout_s: float = 30.0):
        self.decode = decode
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="mock-front")
        self.thread.start()

        async def boot():
            driver = RequestDriver([], [Replica(getattr(decode, "name", "decode-0"), "decode", decode)],
                                   DriverSettings(mode="colocated"))
            self.serving = Serving(driver, facts, "colocated")
            self.http, http_port = await start_http_server(build_app(self.serving), "127.0.0.1:0")
            self.grpc, grpc_port, _ = await start_grpc_server(TandemServicer(self.serving), "127.0.0.1:0")
            return http_port, grpc_port

        http_port, grpc_port = asyncio.run_coroutine_threadsafe(boot(), self.loop).result(timeout_s)
        self.url, self.target = f"http://127.0.0.1:{http_port}/v1", f"127.0.0.1:{grpc_port}"

    def close(self) -> None:
        async def stop():
            await self.http.stop()
            await self.grpc.stop(1)
            self.serving.close()

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
