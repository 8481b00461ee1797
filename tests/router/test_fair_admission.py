"""Admission under the fair policy (router/admission.py): requests start in fair order, so a tenant's expected
wait is its own backlog over its share of the cluster's starts, and one tenant's backlog gets no other refused."""

from __future__ import annotations

import pytest

from tandem.engine.engine_config import SchedulingConfig
from tandem.router.admission import AdmissionController, AtCapacity
from tandem.router.limits import AdmissionSettings
from tests.router.test_admission import FakeClock, start_every


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
