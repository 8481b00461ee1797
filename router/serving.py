"""What the router's two front doors (gRPC in grpc_service.py, OpenAI HTTP in http_service.py) share: one
request driver, authentication, per-tenant admission (tenant_gate.py), admission under overload (admission.py:
a request the cluster cannot start in time is refused at once), validation off the event loop, the
registry of running requests (ids are scoped by tenant and unique across both APIs; a tenant's Abort reaches its own
requests of either API and no one else's), deadlines, usage and timings, and metrics. Errors are named by gRPC
status (error_code); each front door maps those names to its own wire format, so both APIs fail the same way for the
same cause."""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import AsyncIterator, Callable, TypeVar

from tandem.proto.v1 import tandem_pb2 as pb
from tandem.router.accounting import Accounting
from tandem.router.admission import AdmissionController, AtCapacity
from tandem.router.auth import Authenticator, Unauthenticated, cache_salt_for
from tandem.router.lifecycle import Progress, RequestDriver
from tandem.router.limits import ServingLimits
from tandem.router.metrics import RouterMetrics
from tandem.router.pool_signals import PoolSignals
from tandem.router.replicas import NoCapacityError, NoReplicaError, ReplicaLostError, is_replica_death
from tandem.router.request_parsing import InvalidRequest, ModelFacts, ParsedRequest, parse_request
from tandem.router.run_key import RunKey
from tandem.router.rate_limits import RateCharge, RateLimited, TenantRates
from tandem.router.tenant_gate import Admission, TenantGate, TooManyRequests
from tandem.router.tracing import RefusedTrace, RequestTrace, RequestTracer

_log = logging.getLogger(__name__)
T = TypeVar("T")


class RequestCancelled(Exception):
    """An Abort call cancelled the request (CANCELLED)."""


class DeadlineExceeded(Exception):
    """The request's deadline passed (DEADLINE_EXCEEDED); it was aborted on every replica."""


class Draining(Exception):
    """The router is draining (SIGTERM to `tandem up`, `tandem down --drain`): it admits nothing new
    (UNAVAILABLE / HTTP 503, Retry-After retry_after_s) and finishes the requests it runs."""

    retry_after_s = 1  # another router, or the next release, takes the request now

    def __init__(self):
        super().__init__("this router is draining (stopping or being replaced) and takes no new requests; retry: "
                         "another router or the next release takes it")


DRAIN_POLL_S = 0.05  # how often a draining router looks whether its requests have ended


def error_code(error: BaseException) -> tuple[str, str]:
    """The gRPC status name a failed request ends with, and its message for the client."""
    if isinstance(error, InvalidRequest):
        return error.code, str(error)
    if isinstance(error, Unauthenticated):
        return "UNAUTHENTICATED", str(error)
    if isinstance(error, RequestCancelled):
        return "CANCELLED", str(error)
    if isinstance(error, DeadlineExceeded):
        return "DEADLINE_EXCEEDED", str(error)
    if isinstance(error, NoCapacityError):
        return "RESOURCE_EXHAUSTED", str(error)
    if isinstance(error, (NoReplicaError, ReplicaLostError, Draining)):
        return "UNAVAILABLE", str(error)
    if is_replica_death(error):
        return "UNAVAILABLE", f"a replica serving the request died: {error}"
    if isinstance(error, ValueError):  # the engine's own validation (RequestRejectedError is one)
        return "INVALID_ARGUMENT", str(error).splitlines()[-1] if str(error) else repr(error)
    return "INTERNAL", f"internal error: {error!r}"


def refusal_reason(error: Exception) -> str:
    """Which check refused a request before it ran, for its trace: "rate_limit:<requests|tokens>",
    "admission:<reason>" (AtCapacity's), "tenant_max_requests", "draining", or the error's status otherwise."""
    if isinstance(error, RateLimited):
        return f"rate_limit:{error.limit}"
    if isinstance(error, AtCapacity):
        return f"admission:{error.reason}"
    if isinstance(error, TooManyRequests):
        return "tenant_max_requests"
    if isinstance(error, Draining):
        return "draining"
    return error_code(error)[0]


@dataclass(frozen=True)
class RequestKey:
    """A running request in the registry: ids are the client's choice, so they are scoped by tenant (None: auth
    is off). The replicas know each run of it by a RunKey (run_key.py)."""

    tenant: str | None
    request_id: str


@dataclass
class Step:
    """One progress of a request, with its running accounting and the time it reached the router."""

    progress: Progress
    account: Accounting
    now: float


class Serving:
    def __init__(self, driver: RequestDriver, model: ModelFacts, mode: str, *, auth: Authenticator | None = None,
                 limits: ServingLimits | None = None, tracer: RequestTracer | None = None):
        """tracer: writes each request's trace when it ends (router/tracing.py); None: no traces."""
        self.driver = driver
        self.limits = limits or ServingLimits()
        self.model = model if model.lora is not None else replace(model, lora=driver.pools.adapters)
        self.mode = mode
        self.auth = auth or Authenticator()
        self.gate = TenantGate(self.limits)
        rooms = (driver.settings.decode_room, driver.settings.waiting_room)
        self.admission = AdmissionController(self.limits.admission, queue_timeout_s=driver.settings.queue_timeout_s,
                                             max_queued_requests=driver.settings.max_queued_requests,
                                             fair=next((room for room in rooms if room.policy == "fair"), None))
        # Tokenizing and chat templates run here, never on the event loop: a huge prompt delays only itself.
        self._parser = ThreadPoolExecutor(self.limits.limits.parse_threads, thread_name_prefix="tandem-parse")
        self.active: dict[RequestKey, asyncio.Task] = {}
        self._runs = 0  # requests run so far: each one's RunKey.run
        self._ended_by: dict[RequestKey, str] = {}  # why a task was cancelled: "abort" or "deadline" (else: client)
        self.num_finished = 0
        self.num_failed = 0
        self.draining = False  # drain(): nothing new is admitted
        self.metrics = RouterMetrics(driver, lambda: len(self.active))
        self.signals = PoolSignals()  # what the autoscaler reads of each pool (router/pool_signals.py)
        self.metrics.watch_admission(self.admission)
        self.rates = TenantRates(self.limits, self.metrics.registry)  # each tenant's requests and tokens a minute
        self.tracer = tracer

    def authenticate(self, authorization: str | None, api: str) -> str | None:
        """The caller's tenant (None: authentication is off). Raises Unauthenticated."""
        try:
            return self.auth.tenant(authorization)
        except Unauthenticated:
            self.metrics.auth_failures.labels(api).inc()
            raise

    def admit(self, tenant: str | None, count: int, api: str) -> Admission:
        """Lets count requests of tenant in before any work is done for them. Raises TooManyRequests (counted)."""
        try:
            return self.gate.admit(tenant, count)
        except TooManyRequests as e:
            self.refused(api, e.code)
            raise

    def _charge(self, parsed: ParsedRequest, api: str) -> RateCharge:
        """Takes the request from its tenant's rate limits (router/rate_limits.py). Raises RateLimited (counted)."""
        try:
            return self.rates.charge(parsed.tenant, len(parsed.prompt_token_ids),
                                     parsed.params.max_tokens * parsed.params.n)
        except RateLimited as e:
            self.refused(api, e.code)
            raise

    def let_in(self, count: int, api: str, tenant: str | None, arrival: float, trace_parent: str | None) -> Admission:
        """The front doors' checks before parsing: check_capacity, then the tenant gate's admit. A refusal
        (AtCapacity, Draining, TooManyRequests: counted) is raised after its trace is written (arrival: the
        request's, monotonic; trace_parent: the client's W3C traceparent)."""
        decided = time.monotonic()
        try:
            self.check_capacity(count, api, tenant)
            return self.admit(tenant, count, api)
        except (AtCapacity, Draining, TooManyRequests) as e:
            self.trace_refusal(e, api, tenant, arrival, decided, trace_parent)
            raise

    def trace_refusal(self, error: Exception, api: str, tenant: str | None, arrival: float, decided: float,
                      trace_parent: str | None, request_id: str = "") -> None:
        """Writes the trace of a request refused before it ran (router/tracing.py's refused()), when tracing is
        on. decided: when the refusing check began (monotonic)."""
        if self.tracer is not None:
            self.tracer.refused(trace_parent, RefusedTrace(api, error_code(error)[0], refusal_reason(error), tenant,
                                                           arrival, decided, time.monotonic(), request_id))

    def check_capacity(self, count: int, api: str, tenant: str | None = None) -> None:
        """Refuses count requests of tenant at once (AtCapacity, counted) when the cluster could not start them in
        time; holds nothing. The front doors call it before parsing, so a refusal costs no tokenizing; run() decides.
        Raises Draining (counted) once drain() began."""
        self._refuse_if_draining(api)
        try:
            self.admission.check(count, tenant)
        except AtCapacity as e:
            self._at_capacity(api, e, count)
            raise

    def _refuse_if_draining(self, api: str) -> None:
        if self.draining:
            self.refused(api, "UNAVAILABLE")
            raise Draining()

    async def drain(self, timeout_s: float) -> int:
        """Stops admitting (from now on check_capacity and run raise Draining) and waits until the requests running
        end, at most timeout_s. Returns how many were still running then (0: drained)."""
        self.draining = True
        deadline = time.monotonic() + timeout_s
        while self.active and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        return len(self.active)

    def _at_capacity(self, api: str, error: AtCapacity, count: int = 1) -> None:
        self.refused(api, "RESOURCE_EXHAUSTED")
        self.signals.refused(count)  # demand the autoscaler should see, though no replica did
        self.metrics.admission_refusals.labels(error.reason).inc()

    async def off_loop(self, fn: Callable[..., T], *args) -> T:
        """fn(*args) on the router's parse threads (blocking work: tokenizing, JSON, templates)."""
        return await asyncio.get_running_loop().run_in_executor(self._parser, fn, *args)

    async def parse(self, request: pb.GenerateRequest, tenant: str | None, api: str) -> ParsedRequest:
        """Parses on the router's parse threads. Raises InvalidRequest (counted as a failed request of `api`).
        The tenant's priority range clamps the priority; session ids are scoped by tenant: two tenants choosing
        the same id do not share a session."""
        try:
            parsed = await self.off_loop(parse_request, request, self.model, self.limits.limits)
        except InvalidRequest as e:
            self.refused(api, e.code)
            if e.structured_output:
                self.metrics.structured.labels("invalid").inc()
            raise
        session = f"{tenant}/{parsed.session_id}" if tenant is not None and parsed.session_id else parsed.session_id
        priority = self.limits.tenant(tenant).priority.clamp(parsed.priority)
        return replace(parsed, cache_salt=cache_salt_for(tenant), session_id=session, priority=priority,
                       tenant=tenant)

    def refused(self, api: str, code: str) -> None:
        """Counts a request refused before it ran (a malformed body, a bad parameter)."""
        self.num_failed += 1
        self.metrics.requests.labels(api, code).inc()

    def deadline(self, arrival: float, timeout_s: float | None) -> float:
        """The monotonic time a request that arrived at `arrival` must end by: the manifest's request_timeout_s,
        or the client's timeout_s when that is sooner. Raises InvalidRequest for a timeout that is not positive."""
        if timeout_s is not None and not timeout_s > 0:
            raise InvalidRequest(f"timeout must be a positive number of seconds, got {timeout_s!r}")
        limit = self.limits.request_timeout_s
        return arrival + (limit if timeout_s is None else min(limit, timeout_s))

    async def run(self, parsed: ParsedRequest, arrival: float, api: str, *, deadline: float | None = None,
                  trace_parent: str | None = None) -> AsyncIterator[Step]:
        """Drives one request, yielding each progress, until its deadline (monotonic; None: the manifest's
        request_timeout_s from arrival). Raises InvalidRequest (ALREADY_EXISTS for an id the tenant has in use),
        Draining once drain() began, RateLimited past its tenant's requests or tokens a minute, AtCapacity (before
        any replica is called) when the cluster cannot start it in time, RequestCancelled after an Abort call,
        DeadlineExceeded, the driver's errors, or CancelledError when the caller went away; in every case but
        success the request is aborted on every replica (the driver does). Metrics and counters are updated, its
        tokens counted against its tenant's rate limit, and its trace written (trace_parent: the client's W3C
        traceparent), however it ends."""
        key = RequestKey(parsed.tenant, parsed.request_id)
        entered = time.monotonic()
        try:
            self._refuse_if_draining(api)
            if key in self.active:
                self.metrics.finished(api, "ALREADY_EXISTS", None, None)
                raise InvalidRequest(f"request id {parsed.request_id!r} is in use", "ALREADY_EXISTS")
            charge = self._charge(parsed, api)  # settled in the finally below with the tokens it generated
            try:
                ticket = self.admission.admit(parsed.tenant)  # closed in the finally below, however it ends
            except AtCapacity as e:
                charge.refund()
                self._at_capacity(api, e)
                raise
        except (Draining, InvalidRequest, AtCapacity) as e:
            self.trace_refusal(e, api, parsed.tenant, arrival, entered, trace_parent, parsed.request_id)
            raise
        task = asyncio.current_task()
        self.active[key] = task
        self._runs += 1
        run_key = RunKey(parsed.tenant, parsed.request_id, self._runs)
        deadline = self.deadline(arrival, None) if deadline is None else deadline
        timer = asyncio.get_running_loop().call_later(max(0.0, deadline - time.monotonic()), self._cancel, key,
                                                      "deadline")
        account = Accounting(arrival)
        started = time.monotonic()
        tracer = self.tracer
        opened = tracer.begin(trace_parent, arrival) if tracer is not None else None
        if opened is not None:  # the replicas write their spans under the request's
            parsed = replace(parsed, trace=opened.traceparent)
        asked = parsed.params.max_tokens * parsed.params.n
        self.signals.arrived(len(parsed.prompt_token_ids), asked, arrival)
        decode_replica = prefill_replica = ""
        code = "OK"
        try:
            # Replicas know it by run_key's id, unique across tenants and runs; the outputs carry the client's own.
            async for progress in self.driver.run(parsed, run_key):
                ticket.started()
                now = time.monotonic()
                gaps = account.observe(progress, now)
                decode_replica = progress.decode_replica or decode_replica
                prefill_replica = progress.prefill_replica or prefill_replica
                self.metrics.observe_gaps(gaps)
                self.signals.observe(progress, arrival, gaps, now, decode_replica)
                yield Step(progress, account, now)
        except asyncio.CancelledError:
            code = "CANCELLED"
            why = self._ended_by.get(key)
            if why is None:
                raise  # the client went away: nobody to answer
            if why == "deadline":
                code = "DEADLINE_EXCEEDED"
                raise DeadlineExceeded(f"request {parsed.request_id!r} did not finish within its deadline "
                                       f"({deadline - arrival:g} s)") from None
            raise RequestCancelled(f"request {parsed.request_id!r} was aborted") from None
        except Exception as e:
            code, _ = error_code(e)
            if code == "INTERNAL":
                _log.exception("request %s failed", run_key.replica_id())
            raise
        finally:
            ticket.close()
            charge.settle(account.completion_tokens)
            timer.cancel()
            self.active.pop(key, None)
            self._ended_by.pop(key, None)
            self.signals.finished(account.completion_tokens, asked, decode_replica, ok=code == "OK")
            if code == "OK":
                self.num_finished += 1
            else:
                self.num_failed += 1
            ok = code == "OK"
            self.metrics.finished(api, code, account if ok else None, account.timings(time.monotonic()) if ok else None,
                                  structured=parsed.params.structured is not None)
            if opened is not None:
                tracer.record(opened, RequestTrace(
                    parsed.request_id, api, code, entered, started, time.monotonic(), account.first, account.last,
                    queue_s=account.queue_s, prefill_s=account.prefill_s, prefill_queue_s=account.prefill_queue_s,
                    transfer_s=account.transfer_s, admission_s=account.admission_s,
                    prefill_route=account.prefill_route, prefill_replica=prefill_replica,
                    decode_replica=decode_replica, prompt_tokens=account.prompt_tokens,
                    cached_tokens=account.cached_tokens, completion_tokens=account.completion_tokens,
                    tenant=parsed.tenant))

    def _cancel(self, key: RequestKey, why: str) -> bool:
        task = self.active.get(key)
        if task is not None and key not in self._ended_by:
            self._ended_by[key] = why
            task.cancel()
        return task is not None

    def abort(self, tenant: str | None, request_id: str) -> bool:
        """Cancels tenant's running request (either API); whether it was running. Another tenant's request of
        the same id is a different request: it is neither found nor touched."""
        return self._cancel(RequestKey(tenant, request_id), "abort")

    def close(self) -> None:
        """Stops the parse threads (requests still parsing finish first)."""
        self._parser.shutdown(wait=False, cancel_futures=True)
