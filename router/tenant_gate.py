"""Per-tenant admission: how many requests each tenant has in flight and queued at the router, held against its
cap (router/limits.py TenantLimits.max_requests) before any work is done for a new one. A tenant past its cap
is refused at once (TooManyRequests: HTTP 429 with Retry-After, gRPC RESOURCE_EXHAUSTED); the requests of other
tenants never wait on it. Plain Python, one event loop: no locks."""

from __future__ import annotations

from collections import Counter

from tandem.router.limits import ServingLimits
from tandem.router.request_parsing import InvalidRequest


class TooManyRequests(InvalidRequest):
    """The tenant has max_requests in flight already. retry_after_s: what the client is told to wait."""

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message, "RESOURCE_EXHAUSTED")
        self.retry_after_s = retry_after_s


class Admission:
    """count requests of one tenant let in; release() gives back one, close() the rest (both idempotent)."""

    def __init__(self, gate: TenantGate, tenant: str | None, count: int):
        self.gate, self.tenant, self.left = gate, tenant, count

    def release(self, count: int = 1) -> None:
        count = min(count, self.left)
        if count:
            self.left -= count
            self.gate._leave(self.tenant, count)

    def close(self) -> None:
        self.release(self.left)


class TenantGate:
    def __init__(self, limits: ServingLimits):
        self.limits = limits
        self.held: Counter[str | None] = Counter()  # tenant -> requests in flight and queued

    def admit(self, tenant: str | None, count: int = 1) -> Admission:
        """Lets count requests of tenant in (a batched completion is several). Raises TooManyRequests, holding
        nothing, when that would take the tenant past its cap."""
        limits = self.limits.tenant(tenant)
        cap = limits.max_requests
        if cap is not None and self.held[tenant] + count > cap:
            who = "this tenant" if tenant is None else f"tenant {tenant!r}"
            raise TooManyRequests(f"{who} has {self.held[tenant]} requests in flight, and at most {cap} are "
                                  f"allowed at once; retry after {limits.retry_after_s} s", limits.retry_after_s)
        self.held[tenant] += count
        return Admission(self, tenant, count)

    def _leave(self, tenant: str | None, count: int) -> None:
        self.held[tenant] -= count
        if self.held[tenant] <= 0:
            del self.held[tenant]
