"""The router process: a Ray actor that serves the gRPC API and the OpenAI-compatible HTTP API, and drives every
request across the replicas the control plane hands it. The actor runs on Ray's asyncio loop; so do both
servers, every request and the KV feed that keeps the routing index current. It reads the model's tokenizer and
config without its weights and without torch (engine/loader/model_info.py): the router never runs the model."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from tandem.engine.heap import settle
from tandem.engine.loader.model_info import load_model_info
from tandem.replica.contract import DecodeReplicaAPI, PrefillReplicaAPI, ReadyReplica
from tandem.router.auth import Authenticator
from tandem.router.driver_settings import DriverSettings
from tandem.router.lifecycle import RequestDriver
from tandem.router.limits import ServingLimits
from tandem.router.pool_signals import PoolLoad, PoolScaling
from tandem.router.replicas import Replica
from tandem.router.request_parsing import ModelFacts
from tandem.router.tls import TLSConfig
from tandem.router.tracing import RequestTracer, TracingConfig

_log = logging.getLogger(__name__)
DRAIN_POLL_S = 0.1
ABORT_SETTLE_S = 5.0  # how long stop() waits for aborts still going on


def model_id_for(model_path: str | None) -> str:
    """The id clients name the model by: the file or folder name without a quantization suffix."""
    if model_path is None:
        return "SmolLM2-135M-Instruct"
    name = Path(model_path).name
    return name.removesuffix(".gguf").split(".Q")[0] if name.endswith(".gguf") else name


@dataclass(frozen=True)
class RouterStats:
    """What the router reports to the control plane (`tandem status`). state: "starting" until start() returned
    (the other fields are then empty), then "serving". Requests are counts; prefill_decisions counts prompts by
    "where/reason" (routing.py); kv_feed: the KV feed's counters; in_flight: requests in flight per replica."""

    state: str
    endpoint: str | None = None
    http_endpoint: str | None = None
    policy: str = ""
    active_requests: int = 0
    queued_requests: int = 0
    finished_requests: int = 0
    failed_requests: int = 0
    transfer_fallbacks: int = 0
    migrations: int = 0  # requests moved to another decode replica by token replay (each move)
    prefill_retries: int = 0  # prompts prefilled again after their prefill replica died
    replicas_lost: list[str] = field(default_factory=list)
    prefill_decisions: dict[str, int] = field(default_factory=dict)
    kv_feed: dict[str, int] = field(default_factory=dict)
    in_flight: dict[str, int] = field(default_factory=dict)


class RouterActor:
    def __init__(self, model_path: str | None, settings: DriverSettings):
        model = load_model_info(model_path)
        self.tokenizer = model.tokenizer
        self.config = model.config
        self.model_path = model_path
        self.settings = settings
        self.serving = None
        self.grpc_server = None
        self.grpc_health = None
        self.http_server = None
        self.endpoints: dict[str, str | None] = {"grpc": None, "http": None}
        self._feed_task: asyncio.Task | None = None
        self._lag_task: asyncio.Task | None = None

    async def start(self, replicas: list[ReadyReplica], grpc_address: str, http_address: str | None = None,
                    api_keys: dict[str, str] | None = None, *, limits: ServingLimits | None = None,
                    tls: TLSConfig | None = None, tracing: TracingConfig | None = None,
                    settle_heap: bool = False) -> dict[str, str | None]:
        """replicas: every ready replica of both pools. api_keys: key -> tenant (None: no auth). limits: what
        requests and tenants may ask for (None: the defaults). tls: serve both APIs over TLS only (None:
        plaintext). tracing: send each request's trace to a collector (router/tracing.py; None: no traces, no
        tracer). settle_heap: this process serves until it ends (the control plane's router actor): once
        serving, freeze what it holds so that garbage collections stop scanning it (engine/heap.py); never in a
        process that goes on to do other work (a test's). Starts serving; returns {"grpc": HOST:PORT, "http":
        HOST:PORT or None}."""
        from tandem.router.grpc_service import TandemServicer, start_grpc_server
        from tandem.router.http_service import build_app, start_http_server
        from tandem.router.serving import Serving

        prefill: list[Replica[PrefillReplicaAPI]] = [Replica(r.name, r.pool, r.api, r.info) for r in replicas
                                                     if r.pool == "prefill"]
        decode: list[Replica[DecodeReplicaAPI]] = [Replica(r.name, r.pool, r.api, r.info) for r in replicas
                                                   if r.pool == "decode"]
        limit = min(r.info.max_model_len for r in prefill + decode)
        facts = ModelFacts(model_id_for(self.model_path), self.tokenizer, self.config.vocab_size, limit)
        driver = RequestDriver(prefill, decode, self.settings)
        limits = limits or ServingLimits()
        tracer = RequestTracer(tracing) if tracing is not None and tracing.otlp_endpoint else None
        self.serving = Serving(driver, facts, self.settings.mode, auth=Authenticator(api_keys), limits=limits,
                               tracer=tracer)
        loop = asyncio.get_running_loop()
        self._feed_task = loop.create_task(driver.feed.run(driver.replicas, self.settings.kv_events_interval_s))
        self._lag_task = loop.create_task(self.serving.metrics.watch_loop())
        self.grpc_server, port, self.grpc_health = await start_grpc_server(TandemServicer(self.serving), grpc_address,
                                                            max_message_bytes=limits.limits.max_body_bytes,
                                                            tls=tls)
        self.endpoints["grpc"] = f"{grpc_address.rpartition(':')[0]}:{port}"
        if http_address is not None:
            self.http_server, port = await start_http_server(build_app(self.serving), http_address, tls=tls)
            self.endpoints["http"] = f"{http_address.rpartition(':')[0]}:{port}"
        if settle_heap:
            _log.info("router: %d objects frozen at its start", settle())
        return dict(self.endpoints)

    async def warm(self) -> bool:
        """Imports what start() needs, so that a standby router serves as soon as it is started; the control plane
        calls it as the standby's heartbeat."""
        import tandem.router.grpc_service  # noqa: F401
        import tandem.router.http_service  # noqa: F401
        import tandem.router.serving  # noqa: F401

        return True

    async def stats(self) -> RouterStats:
        serving = self.serving
        if serving is None:
            return RouterStats("starting")
        driver = serving.driver
        return RouterStats(
            "serving", endpoint=self.endpoints["grpc"], http_endpoint=self.endpoints["http"],
            policy=self.settings.routing.policy, active_requests=len(serving.active),
            queued_requests=driver.num_queued, finished_requests=serving.num_finished,
            failed_requests=serving.num_failed, transfer_fallbacks=driver.num_fallbacks,
            migrations=driver.num_migrations, prefill_retries=driver.num_prefill_retries,
            replicas_lost=list(driver.lost),
            prefill_decisions={f"{where}/{reason}": n for (where, reason), n in driver.routing.decisions.items()},
            kv_feed=dict(vars(driver.feed.counters)),
            in_flight={r.name: r.load.in_flight for r in driver.replicas()})

    # -- what the control plane changes while serving ------------------------------------------------------

    async def pool_load(self, pool: str) -> PoolLoad:
        """What the router measured of one pool ("prefill" | "decode") over its window, for the autoscaler."""
        driver = self._driver()
        replicas = driver.prefill if pool == "prefill" else driver.decode
        if pool == "prefill":
            return self.serving.signals.load(pool, replicas, waiting_tokens=driver.prefill_waiting_tokens)
        return self.serving.signals.load(pool, replicas, queued=driver.num_queued, waiting=driver.num_waiting_prefill)

    async def report_scaling(self, states: list[PoolScaling]) -> None:
        """The control plane's view of each pool's scaling, exposed on /metrics until the next report."""
        self.serving.metrics.scaling = {state.pool: state for state in states}

    async def add_replica(self, replica: ReadyReplica) -> None:
        """Starts routing to a replica that became ready (scaled up, or replacing a dead one)."""
        self._driver().add(Replica(replica.name, replica.pool, replica.api, replica.info))
        _log.info("routing to new replica %s", replica.name)

    async def drain_replica(self, name: str, timeout_s: float) -> int:
        """Stops sending new requests to a replica and waits until the requests it has finish, at most
        timeout_s. Returns how many were still in flight then (0: drained). Unknown names drain at once."""
        driver = self._driver()
        replica = next((r for r in driver.replicas() if r.name == name), None)
        if replica is None:
            return 0
        driver.remove(name)  # requests on it keep their handle and finish there
        deadline = time.monotonic() + timeout_s
        while replica.load.in_flight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        return replica.load.in_flight

    async def drain(self, timeout_s: float) -> int:
        """Drains the router before it stops: /health and gRPC health turn not-serving (load balancers move away),
        new requests get UNAVAILABLE / 503 with Retry-After, and the running ones may finish for up to timeout_s.
        Returns how many were still running then (0: drained); stop() ends those."""
        serving = self.serving
        if serving is None:
            return 0
        _log.warning("draining: no new requests; %d running, up to %g s to finish", len(serving.active), timeout_s)
        if self.grpc_health is not None:
            from tandem.router.grpc_service import drain_health

            await drain_health(self.grpc_health)
        left = await serving.drain(timeout_s)
        _log.warning("drained" if left == 0 else "drain timeout: %d request(s) still running are ended", left)
        return left

    async def remove_replica(self, name: str, reason: str) -> bool:
        """Stops routing to a replica the control plane found dead (requests still on it find out on their own
        next call); returns whether it was routed to."""
        driver = self._driver()
        if not driver.remove(name):
            return False
        driver.lost.append(name)
        _log.error("replica %s removed from routing: %s", name, reason)
        return True

    def _driver(self) -> RequestDriver:
        if self.serving is None:
            raise RuntimeError("the router has not started")
        return self.serving.driver

    async def stop(self, grace_s: float = 2.0) -> None:
        for task in (self._feed_task, self._lag_task):
            if task is not None:
                task.cancel()
        self._feed_task = self._lag_task = None
        if self.http_server is not None:
            await self.http_server.stop()
            self.http_server = None
        if self.grpc_server is not None:
            await self.grpc_server.stop(grace_s)
            self.grpc_server = None
        if self.serving is not None:  # replicas still being told to drop ended requests (router/aborts.py)
            await self.serving.driver.aborts.settle(ABORT_SETTLE_S)
        if self.serving is not None and self.serving.tracer is not None:
            tracer, self.serving.tracer = self.serving.tracer, None
            await asyncio.to_thread(tracer.shutdown)  # sends the last traces (it may wait on the network)
