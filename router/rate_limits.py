"""Per-tenant rate limits (`auth.tenants.<name>.requests_per_minute`, `tokens_per_minute`; `default_tenant`'s for
everyone else): a token bucket per tenant and limit, holding at most one minute's allowance and refilled
continuously at that rate, checked when a request is about to run (parsed: its prompt's tokens are known).

A request takes one unit of the request bucket and, of the token bucket, its prompt's tokens plus the most it may
generate (max_tokens times n), as OpenAI's limits count a request before it runs, or a whole minute's allowance
when it may use more than that; when it ends, the bucket is settled with what it used (its prompt and the tokens
it generated): what it took and did not use goes back, what it used beyond that is taken (the bucket may go below
empty: the tenant then waits longer). A request the buckets cannot cover is refused at once (RateLimited: HTTP 429
with Retry-After, gRPC RESOURCE_EXHAUSTED with a retry-after trailer), Retry-After being the time the bucket needs
to refill what is missing, in whole seconds; it takes nothing from either bucket.

Counted per tenant in /metrics: tandem_tenant_rate_limited (by limit: requests, tokens) and tandem_tenant_tokens
(by kind: prompt, completion). Plain Python on the router's event loop, clock injected."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

from prometheus_client import CollectorRegistry, Counter

from tandem.router.limits import ServingLimits
from tandem.router.tenant_gate import TooManyRequests

NO_TENANT = ""  # the tenant label when authentication is off


class RateLimited(TooManyRequests):
    """A tenant's requests or tokens per minute would be exceeded (RESOURCE_EXHAUSTED / 429). limit: "requests"
    or "tokens"; retry_after_s: when the bucket will hold enough again (whole seconds)."""

    def __init__(self, message: str, retry_after_s: int, limit: str):
        super().__init__(message, retry_after_s)
        self.limit = limit


class TokenBucket:
    """per_minute units at most, refilled continuously at per_minute a minute (monotonic seconds)."""

    def __init__(self, per_minute: int, now: float):
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0  # units a second
        self.level = self.capacity
        self._at = now

    def refill(self, now: float) -> float:
        """The level at `now`."""
        self.level = min(self.capacity, self.level + (now - self._at) * self.rate)
        self._at = max(self._at, now)
        return self.level

    def wait_s(self, amount: float, now: float) -> float:
        """Seconds until the bucket holds amount, at most its capacity (0: it does now)."""
        return max(0.0, min(amount, self.capacity) - self.refill(now)) / self.rate

    def take(self, amount: float, now: float) -> None:
        """Takes amount (the level may go below zero)."""
        self.level = self.refill(now) - amount

    def give_back(self, amount: float, now: float) -> None:
        self.level = min(self.capacity, self.refill(now) + amount)


@dataclass
class RateCharge:
    """What one request took from its tenant's token bucket (charged 0: the tenant has no token limit)."""

    rates: TenantRates
    tenant: str | None
    prompt_tokens: int
    charged: int
    settled: bool = False

    def refund(self) -> None:
        """The request did not run (refused after its charge): gives back all it took. Idempotent (with settle)."""
        if not self.settled:
            self.settled = True
            self.rates.refunded(self)

    def settle(self, completion_tokens: int) -> None:
        """The request ended having generated completion_tokens: settles its tenant's token bucket with what it
        used (see the module docstring) and counts its tokens. Idempotent."""
        if self.settled:
            return
        self.settled = True
        self.rates.settled(self, completion_tokens)


class TenantRates:
    def __init__(self, limits: ServingLimits, registry: CollectorRegistry, *,
                 clock: Callable[[], float] = time.monotonic):
        self.limits, self.clock = limits, clock
        self._requests: dict[str | None, TokenBucket] = {}
        self._tokens: dict[str | None, TokenBucket] = {}
        self.refusals = Counter("tandem_tenant_rate_limited", "Requests refused by a tenant's rate limit, by tenant "
                                "and limit (requests, tokens: per minute)", ["tenant", "limit"], registry=registry)
        self.tokens = Counter("tandem_tenant_tokens", "Tokens of finished requests by tenant and kind (prompt, "
                              "completion)", ["tenant", "kind"], registry=registry)

    def charge(self, tenant: str | None, prompt_tokens: int, max_output_tokens: int) -> RateCharge:
        """Takes one request and prompt_tokens + max_output_tokens from tenant's buckets. Raises RateLimited,
        taking nothing, when either cannot cover it."""
        limits, now = self.limits.tenant(tenant), self.clock()
        requests = self._bucket(self._requests, tenant, limits.requests_per_minute, now)
        tokens = self._bucket(self._tokens, tenant, limits.tokens_per_minute, now)
        wanted = prompt_tokens + max_output_tokens
        who = "this tenant" if tenant is None else f"tenant {tenant!r}"
        if requests is not None and (wait := requests.wait_s(1, now)) > 0:
            self._refuse(tenant, "requests", f"{who} may send {limits.requests_per_minute} requests a minute",
                         wait)
        if tokens is not None and (wait := tokens.wait_s(wanted, now)) > 0:
            self._refuse(tenant, "tokens", f"{who} may use {limits.tokens_per_minute} tokens a minute (prompt and "
                         f"generated; this request may use {wanted})", wait)
        charged = 0
        if requests is not None:
            requests.take(1, now)
        if tokens is not None:
            charged = int(min(wanted, tokens.capacity))
            tokens.take(charged, now)
        return RateCharge(self, tenant, prompt_tokens, charged)

    def refunded(self, charge: RateCharge) -> None:
        now = self.clock()
        if (requests := self._requests.get(charge.tenant)) is not None:
            requests.give_back(1, now)
        if (tokens := self._tokens.get(charge.tenant)) is not None and charge.charged:
            tokens.give_back(charge.charged, now)

    def settled(self, charge: RateCharge, completion_tokens: int) -> None:
        label = _label(charge.tenant)
        self.tokens.labels(label, "prompt").inc(charge.prompt_tokens)
        self.tokens.labels(label, "completion").inc(completion_tokens)
        bucket = self._tokens.get(charge.tenant)
        if bucket is None or not charge.charged:
            return
        unused = charge.charged - charge.prompt_tokens - completion_tokens
        if unused > 0:
            bucket.give_back(unused, self.clock())
        else:
            bucket.take(-unused, self.clock())

    def _bucket(self, buckets: dict[str | None, TokenBucket], tenant: str | None, per_minute: int | None,
                now: float) -> TokenBucket | None:
        """tenant's bucket (made full on its first request); None when the limit is off."""
        if per_minute is None:
            return None
        if tenant not in buckets:
            buckets[tenant] = TokenBucket(per_minute, now)
        return buckets[tenant]

    def _refuse(self, tenant: str | None, limit: str, why: str, wait_s: float) -> None:
        self.refusals.labels(_label(tenant), limit).inc()
        retry_after_s = max(1, math.ceil(wait_s))
        raise RateLimited(f"{why}; retry after {retry_after_s} s", retry_after_s, limit)


def _label(tenant: str | None) -> str:
    return NO_TENANT if tenant is None else tenant
