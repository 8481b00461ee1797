"""What the router's two front doors (gRPC in grpc_service.py, OpenAI HTTP in http_service.py) share: one
request driver, authentication, validation, the registry of running requests (ids are unique across both APIs;
Abort reaches either), usage and timings, and metrics. Errors are named by gRPC status (error_code); each front
door maps those names to its own wire format, so both APIs fail the same way for the same cause."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, replace
from typing import AsyncIterator

from tandem.proto.v1 import tandem_pb2 as pb
from tandem.router.accounting import Accounting
from tandem.router.auth import Authenticator, Unauthenticated, cache_salt_for
from tandem.router.limits import ServingLimits
from tandem.router.lifecycle import (NoCapacityError, NoReplicaError, Progress, ReplicaLostError, RequestDriver,
                                     is_replica_death)
from tandem.router.metrics import RouterMetrics
from tandem.router.request_parsing import InvalidRequest, ModelFacts, ParsedRequest, parse_request

_log = logging.getLogger(__name__)


class RequestCancelled(Exception):
    """An Abort call cancelled the request (CANCELLED)."""


def error_code(error: BaseException) -> tuple[str, str]:
    """The gRPC status name a failed request ends with, and its message for the client."""
    if isinstance(error, InvalidRequest):
        return error.code, str(error)
    if isinstance(error, Unauthenticated):
        return "UNAUTHENTICATED", str(error)
    if isinstance(error, RequestCancelled):
        return "CANCELLED", str(error)
    if isinstance(error, NoCapacityError):
        return "RESOURCE_EXHAUSTED", str(error)
    if isinstance(error, (NoReplicaError, ReplicaLostError)):
        return "UNAVAILABLE", str(error)
    if is_replica_death(error):
        return "UNAVAILABLE", f"a replica serving the request died: {error}"
    if isinstance(error, ValueError):  # the engine's own validation (RequestRejectedError is one)
        return "INVALID_ARGUMENT", str(error).splitlines()[-1] if str(error) else repr(error)
    return "INTERNAL", f"internal error: {error!r}"


@dataclass
class Step:
    """One progress of a request, with its running accounting and the time it reached the router."""

    progress: Progress
    account: Accounting
    now: float


class Serving:
    def __init__(self, driver: RequestDriver, model: ModelFacts, mode: str, *, auth: Authenticator | None = None,
                 limits: ServingLimits | None = None):
        self.driver = driver
        self.limits = limits or ServingLimits()
        self.model = model
        self.mode = mode
        self.auth = auth or Authenticator()
        self.active: dict[str, asyncio.Task] = {}
        self._abort_calls: set[str] = set()  # ids whose task an Abort call cancelled (not a gone client)
        self.num_finished = 0
        self.num_failed = 0
        self.metrics = RouterMetrics(driver, lambda: len(self.active))

    def authenticate(self, authorization: str | None, api: str) -> str | None:
        """The caller's tenant (None: authentication is off). Raises Unauthenticated."""
        try:
            return self.auth.tenant(authorization)
        except Unauthenticated:
            self.metrics.auth_failures.labels(api).inc()
            raise

    def parse(self, request: pb.GenerateRequest, tenant: str | None, api: str) -> ParsedRequest:
        """Raises InvalidRequest (counted as a failed request of `api`). Session ids are scoped by tenant: two
        tenants choosing the same id do not share a session."""
        try:
            parsed = parse_request(request, self.model)
            session = f"{tenant}/{parsed.session_id}" if tenant is not None and parsed.session_id else parsed.session_id
            return replace(parsed, cache_salt=cache_salt_for(tenant), session_id=session)
        except InvalidRequest as e:
            self.refused(api, e.code)
            raise

    def refused(self, api: str, code: str) -> None:
        """Counts a request refused before it ran (a malformed body, a bad parameter)."""
        self.num_failed += 1
        self.metrics.requests.labels(api, code).inc()

    async def run(self, parsed: ParsedRequest, arrival: float, api: str) -> AsyncIterator[Step]:
        """Drives one request, yielding each progress. Raises InvalidRequest (ALREADY_EXISTS for an id in use),
        RequestCancelled after an Abort call, the driver's errors, or CancelledError when the caller went away.
        Metrics and counters are updated however it ends."""
        if parsed.request_id in self.active:
            self.metrics.finished(api, "ALREADY_EXISTS", None, None)
            raise InvalidRequest(f"request id {parsed.request_id!r} is in use", "ALREADY_EXISTS")
        self.active[parsed.request_id] = asyncio.current_task()
        account = Accounting(arrival)
        code = "OK"
        try:
            async for progress in self.driver.run(parsed):
                now = time.monotonic()
                self.metrics.observe_gaps(account.observe(progress, now))
                yield Step(progress, account, now)
        except asyncio.CancelledError:
            if parsed.request_id not in self._abort_calls:
                code = "CANCELLED"
                raise  # the client went away: nobody to answer
            code = "CANCELLED"
            raise RequestCancelled(f"request {parsed.request_id!r} was aborted") from None
        except Exception as e:
            code, _ = error_code(e)
            if code == "INTERNAL":
                _log.exception("request %s failed", parsed.request_id)
            raise
        finally:
            self.active.pop(parsed.request_id, None)
            self._abort_calls.discard(parsed.request_id)
            if code == "OK":
                self.num_finished += 1
            else:
                self.num_failed += 1
            ok = code == "OK"
            self.metrics.finished(api, code, account if ok else None, account.timings(time.monotonic()) if ok else None)

    def abort(self, request_id: str) -> bool:
        """Cancels a running request (either API); whether it was running."""
        task = self.active.get(request_id)
        if task is not None:
            self._abort_calls.add(request_id)
            task.cancel()
        return task is not None
