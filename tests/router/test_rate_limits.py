"""Per-tenant rate limits (router/rate_limits.py): token buckets of requests and tokens a minute on a fake clock
(refusal, Retry-After from the refill time, settlement with the tokens used, refunds), and through the router's
two front doors over a mock replica: HTTP 429 with Retry-After and gRPC RESOURCE_EXHAUSTED with a retry-after
trailer for the limited tenant, the other tenant served, both counted per tenant in /metrics."""

from __future__ import annotations

import grpc
import httpx
import pytest
from prometheus_client import CollectorRegistry

from tandem.router.limits import ServingLimits, TenantLimits
from tandem.router.rate_limits import RateLimited, TenantRates
from tests.router.test_limits import BETA, LIMITS, Front


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def rates(**acme) -> tuple[TenantRates, Clock, CollectorRegistry]:
    clock, registry = Clock(), CollectorRegistry()
    limits = ServingLimits(tenants={"acme": TenantLimits(**acme)})
    return TenantRates(limits, registry, clock=clock), clock, registry


def test_requests_a_minute_refuse_the_one_too_many_until_the_bucket_refills():
    r, clock, registry = rates(requests_per_minute=2)
    r.charge("acme", 10, 5).settle(5)
    r.charge("acme", 10, 5).settle(5)
    with pytest.raises(RateLimited) as refused:
        r.charge("acme", 10, 5)
    assert refused.value.limit == "requests" and refused.value.retry_after_s == 30  # one request per 30 s
    assert "2 requests a minute" in str(refused.value) and refused.value.code == "RESOURCE_EXHAUSTED"
    r.charge("beta", 10, 5)  # another tenant, no limit
    r.charge(None, 10, 5)  # authentication off: the default tenant's limits (none)
    clock.now += 29.0
    with pytest.raises(RateLimited):
        r.charge("acme", 10, 5)
    clock.now += 1.0
    r.charge("acme", 10, 5)
    assert registry.get_sample_value("tandem_tenant_rate_limited_total",
                                     {"tenant": "acme", "limit": "requests"}) == 2
    assert registry.get_sample_value("tandem_tenant_tokens_total", {"tenant": "acme", "kind": "prompt"}) == 20
    assert registry.get_sample_value("tandem_tenant_tokens_total", {"tenant": "acme", "kind": "completion"}) == 10


def test_tokens_a_minute_count_the_prompt_and_what_may_be_generated_then_settle_with_what_was():
    r, clock, _ = rates(tokens_per_minute=120)  # 2 tokens a second
    first = r.charge("acme", 20, 50)  # takes 70 of 120
    with pytest.raises(RateLimited) as refused:
        r.charge("acme", 20, 50)  # 50 left, 70 wanted: 20 missing at 2 a second
    assert refused.value.limit == "tokens" and refused.value.retry_after_s == 10
    first.settle(10)  # used 30: 40 go back
    second = r.charge("acme", 20, 50)  # 90 held, takes 70
    second.settle(80)  # used 100, 30 more than it took: the bucket goes to -10
    with pytest.raises(RateLimited) as refused:
        r.charge("acme", 0, 1)
    assert refused.value.retry_after_s == 6  # from -10 to 1 at 2 a second: 5.5 s
    clock.now += 6
    r.charge("acme", 0, 1)


def test_a_request_larger_than_a_minute_runs_on_a_full_bucket_and_one_refused_later_gets_all_back():
    r, clock, _ = rates(tokens_per_minute=60, requests_per_minute=5)
    big = r.charge("acme", 10, 500)  # more than a minute's allowance: takes the whole bucket
    with pytest.raises(RateLimited):
        r.charge("acme", 1, 1)
    big.refund()  # refused after its charge (the cluster had no room): nothing was used
    r.charge("acme", 10, 500)
    big.settle(3)  # settling after a refund changes nothing
    with pytest.raises(RateLimited) as refused:
        r.charge("acme", 1, 1)
    assert refused.value.retry_after_s == 2


@pytest.fixture(scope="module")
def front():
    tenants = {"acme": TenantLimits(requests_per_minute=2), "beta": TenantLimits(tokens_per_minute=100_000)}
    f = Front(ServingLimits(limits=LIMITS, tenants=tenants, request_timeout_s=30.0))
    yield f
    f.close()


def test_the_front_doors_answer_429_with_retry_after_and_serve_the_other_tenant(front):
    assert front.chat().status_code == 200  # as acme (front.chat's and front.generate's default key)
    assert len(front.generate(max_tokens=2)) >= 1
    refused = front.chat()
    assert refused.status_code == 429, refused.text
    assert 1 <= int(refused.headers["Retry-After"]) <= 30
    assert "2 requests a minute" in refused.json()["error"]["message"]
    with pytest.raises(grpc.RpcError) as error:
        front.generate()
    assert error.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert 1 <= int(dict(error.value.trailing_metadata())["retry-after"]) <= 30
    for _ in range(3):
        assert front.chat(headers=BETA).status_code == 200
    metrics = httpx.get(f"{front.url}/metrics").text
    assert 'tandem_tenant_rate_limited_total{limit="requests",tenant="acme"} 2.0' in metrics
    assert 'tandem_tenant_tokens_total{kind="completion",tenant="beta"} 6.0' in metrics
