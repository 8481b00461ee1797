"""Admission control (router/admission.py) on a fake clock: the start rate measured over busy time, a new
request's expected wait against the queue timeout or the TTFT SLO, Retry-After, initial_waiting and
max_queued_requests, idempotent tickets; under the fair policy each tenant's own backlog over its share of the
starts, and the router's Serving taking that policy from its rooms."""

from __future__ import annotations

import pytest

from tandem.engine.engine_config import SchedulingConfig
from tandem.router.admission import AdmissionController, AtCapacity
from tandem.router.driver_settings import DriverSettings
from tandem.router.lifecycle import RequestDriver
from tandem.router.limits import AdmissionSettings
from tandem.router.mocks.replicas import MockDecode
from tandem.router.replicas import Replica
from tandem.router.request_parsing import ModelFacts
from tandem.router.serving import Serving


class FakeClock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


def controller(clock: FakeClock, *, queue_timeout_s: float = 3.0, max_queued_requests: int = 256,
               **settings) -> AdmissionController:
    return AdmissionController(AdmissionSettings(**settings), queue_timeout_s=queue_timeout_s,
                               max_queued_requests=max_queued_requests, clock=clock)


def refusal(admission: AdmissionController) -> AtCapacity:
    held = admission.waiting
    with pytest.raises(AtCapacity) as caught:
        admission.admit()
    assert admission.waiting == held  # a refusal holds nothing
    return caught.value


def start_every(clock: FakeClock, tickets, gap_s: float) -> None:
    for ticket in tickets:
        clock.advance(gap_s)
        ticket.started()


# --- the controller, on a fake clock -----------------------------------------------------------------------------


def test_before_any_rate_is_measured_up_to_initial_waiting_may_wait():
    clock = FakeClock()
    admission = controller(clock, initial_waiting=3)
    tickets = [admission.admit() for _ in range(3)]
    error = refusal(admission)
    assert (error.reason, error.retry_after_s) == ("unmeasured", 1)
    assert "3 requests are waiting to start and no start rate has been measured yet" in str(error)
    assert str(error).startswith("the cluster is at capacity: ")
    tickets[0].started()
    assert admission.waiting == 2
    admission.admit()  # room again


def test_the_start_rate_counts_only_time_when_requests_waited():
    clock = FakeClock()
    admission = controller(clock, initial_waiting=100)
    tickets = [admission.admit() for _ in range(8)]
    start_every(clock, tickets, 0.5)  # 8 starts in 4 s of waiting
    assert admission.start_rate() == pytest.approx(2.0)
    clock.advance(10)  # idle: nothing waited, so the cluster is not taken for a slower one
    assert admission.start_rate() == pytest.approx(2.0)
    more = [admission.admit() for _ in range(4)]
    start_every(clock, more, 0.125)  # 12 starts in 4.5 s of waiting
    assert admission.start_rate() == pytest.approx(12 / 4.5)


def test_the_rate_follows_the_window_and_the_last_one_stays_when_it_empties():
    clock = FakeClock()
    admission = controller(clock, queue_timeout_s=100.0, initial_waiting=100, window_s=10)
    start_every(clock, [admission.admit() for _ in range(8)], 0.5)  # 2 per second
    clock.advance(30)  # the window holds nothing now: the last measurement stays
    assert admission.start_rate() == pytest.approx(2.0)
    start_every(clock, [admission.admit() for _ in range(8)], 0.1)  # a faster cluster (scaled up)
    assert admission.start_rate() == pytest.approx(10.0)


def test_expected_wait_against_the_queue_timeout_and_retry_after_from_the_drain_rate():
    clock = FakeClock()
    admission = controller(clock, queue_timeout_s=3.0, initial_waiting=100)
    tickets = [admission.admit() for _ in range(20)]
    start_every(clock, tickets[:4], 0.5)  # 2 per second; 16 still wait
    error = refusal(admission)
    # (16 + 1) / 2 = 8.5 s > 3 s; the backlog drains below the limit in 5.5 s
    assert (error.reason, error.retry_after_s) == ("queue_timeout", 6)
    assert ("16 requests are waiting to start and it starts about 2.0 per second, so a new one would start in "
            "about 8.5 s, past the queue timeout of 3 s; retry in 6 s") in str(error)
    start_every(clock, tickets[4:15], 0.5)  # 5 wait: (5 + 1) / 2 = 3 s, just within
    admission.admit()
    assert refusal(admission).retry_after_s == 1  # (6 + 1) / 2 = 3.5 s: half a second over, rounded up


def test_slo_mode_admits_against_the_ttft_slo():
    clock = FakeClock()
    admission = controller(clock, queue_timeout_s=30.0, mode="slo", ttft_slo_s=1.0, initial_waiting=100)
    tickets = [admission.admit() for _ in range(10)]
    start_every(clock, tickets[:4], 0.25)  # 4 per second; 6 wait: 7 / 4 = 1.75 s > 1 s
    error = refusal(admission)
    assert error.reason == "slo" and "past its TTFT SLO of 1 s" in str(error) and error.retry_after_s == 1
    start_every(clock, tickets[4:7], 0.25)  # 3 wait: 4 / 4 = 1 s
    admission.admit()


def test_a_request_that_finds_nothing_waiting_is_always_admitted():
    clock = FakeClock()
    admission = controller(clock, queue_timeout_s=0.1, max_queued_requests=0, initial_waiting=1, window_s=60)
    for _ in range(4):  # one at a time, each starting 10 s after it came: 0.1 per second
        start_every(clock, [admission.admit()], 10.0)
    assert admission.start_rate() == pytest.approx(0.1)
    ticket = admission.admit()  # 1 / 0.1 = 10 s expected, but nothing is ahead of it
    assert refusal(admission).reason == "max_queued"
    ticket.close()
    admission.admit()


def test_max_queued_requests_bounds_the_waiting_in_every_mode():
    clock = FakeClock()
    admission = controller(clock, queue_timeout_s=1000.0, max_queued_requests=5, initial_waiting=100)
    tickets = [admission.admit() for _ in range(5)]
    error = refusal(admission)
    assert (error.reason, error.retry_after_s) == ("max_queued", 1)  # no rate yet
    assert "router.max_queued_requests" in str(error)
    start_every(clock, tickets[:4], 1.0)  # 1 per second; 1 waits
    for _ in range(4):
        admission.admit()
    error = refusal(admission)
    assert error.retry_after_s == 1  # one start makes room
    with pytest.raises(AtCapacity) as caught:
        admission.check(4)  # a batch of 4 needs 4 starts
    assert caught.value.retry_after_s == 4


def test_tickets_are_idempotent_and_every_ending_leaves_the_count():
    clock = FakeClock()
    admission = controller(clock)
    started, failed = admission.admit(), admission.admit()
    started.started()
    started.started()
    started.close()  # ended after its first token: already left
    failed.close()
    failed.close()
    assert admission.waiting == 0


def test_slo_mode_needs_a_ttft_slo():
    with pytest.raises(ValueError, match="slo.ttft_s"):
        AdmissionSettings(mode="slo")


def test_under_fair_a_tenants_wait_is_its_own_backlog_over_its_share_of_the_starts():
    clock = FakeClock()
    fair = SchedulingConfig(policy="fair", tenant_weights=(("chat", 1.0), ("batch", 1.0), ("gold", 3.0)))
    admission = AdmissionController(AdmissionSettings(initial_waiting=100), queue_timeout_s=3.0,
                                     max_queued_requests=256, fair=fair, clock=clock)
    batch = [admission.admit("batch") for _ in range(24)]
    start_every(clock, batch[:4], 0.5)  # 2 per second; 20 of batch's wait: (20 + 1) / 2 = 10.5 s
    with pytest.raises(AtCapacity, match="tenant 'batch' has 20 requests waiting to start"):
        admission.admit("batch")
    chat = [admission.admit("chat")]  # nothing of chat's waits: it goes before batch's backlog
    chat += [admission.admit("chat") for _ in range(2)]  # (1 + 1) / (2 x 1/2) = 2 s, then 3 s: within 3 s
    with pytest.raises(AtCapacity) as error:
        admission.admit("chat")  # (3 + 1) / (2 x 1/2) = 4 s
    assert "it starts about 2.0 per second (50% of them its tenant's)" in str(error.value), error.value
    gold = [admission.admit("gold") for _ in range(3)]  # weight 3 of 5: (2 + 1) / (2 x 3/5) = 2.5 s
    with pytest.raises(AtCapacity):
        admission.admit("gold")  # (3 + 1) / (2 x 3/5) = 3.3 s
    for ticket in (*batch, *chat, *gold):
        ticket.close()
    assert admission.waiting == 0 and admission.waiting_by_tenant == {}


@pytest.mark.parametrize("rooms, fair", [
    (dict(), False),
    (dict(decode_room=SchedulingConfig(policy="fair")), True),
    (dict(waiting_room=SchedulingConfig(policy="fair"), decode_room=SchedulingConfig(policy="sjf")), True),
])
def test_serving_admits_by_tenant_when_a_pools_policy_is_fair(rooms, fair):
    driver = RequestDriver([], [Replica("decode-0", "decode", MockDecode("decode-0"))], DriverSettings(**rooms))
    serving = Serving(driver, ModelFacts("m", None, 1000, 512), "colocated")
    assert (serving.admission.fair is not None) is fair
    assert serving.admission.fair is None or serving.admission.fair.policy == "fair"
