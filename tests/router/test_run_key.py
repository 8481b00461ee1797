"""router/run_key.py: the one function that names a request on the replicas (RunKey.replica_id), and the
driver calling the replicas with it while the client's id stays in the request and its outputs."""

from __future__ import annotations

import asyncio
import time

import pytest

from tandem.engine.sampling_params import SamplingParams
from tandem.router.driver_settings import DriverSettings
from tandem.router.lifecycle import RequestDriver
from tandem.router.mocks.replicas import DyingDecode, DyingPrefill, MockDecode, MockPrefill
from tandem.router.replicas import Replica
from tandem.router.request_parsing import ModelFacts, ParsedRequest
from tandem.router.run_key import RunKey
from tandem.router.serving import Serving


def test_the_replica_id_is_scoped_by_tenant_and_run():
    assert RunKey("acme", "r1", 7).replica_id() == "acme/r1/7"
    assert RunKey(None, "r1", 7).replica_id() == "r1/7"  # authentication off
    assert RunKey(None, "r1").replica_id() == "r1"  # a caller that made the id unique itself
    # two tenants, or two runs of one reused id, never meet on a replica
    assert RunKey("acme", "r1", 7).replica_id() != RunKey("beta", "r1", 7).replica_id()
    assert RunKey("acme", "r1", 7).replica_id() != RunKey("acme", "r1", 8).replica_id()


def test_a_move_or_a_local_prefill_is_a_new_attempt_with_its_own_suffix():
    key = RunKey("acme", "r1", 7)
    assert key.moved("p", 1).replica_id() == "acme/r1/7.p1"
    assert key.moved("p", 1).moved("m", 2).replica_id() == "acme/r1/7.m2"  # moves are numbered, not nested
    assert key.prefilled_locally().replica_id() == "acme/r1/7.local"
    assert key.moved("p", 1).prefilled_locally().replica_id() == "acme/r1/7.p1.local"
    assert key.prefilled_locally().moved("m", 2).replica_id() == "acme/r1/7.m2"
    assert key.moved("m", 3).request_id == "r1"  # the client's id is never rewritten
    with pytest.raises(ValueError, match="a move is one of"):
        key.moved("x", 1)
    with pytest.raises(ValueError, match="numbered from 1"):
        key.moved("m", 0)


PROMPT = tuple(range(5, 45))


def serve(prefill, decode, request: ParsedRequest) -> list:
    """Runs request through Serving (the front doors' path) and returns its outputs as the client gets them."""
    driver = RequestDriver([Replica(p.name, "prefill", p) for p in prefill],
                           [Replica(d.name, "decode", d) for d in decode], DriverSettings())
    serving = Serving(driver, ModelFacts("m", None, 1000, 512), "disaggregated")

    async def outputs():
        return [o async for step in serving.run(request, time.monotonic(), "grpc") for o in step.progress.outputs]

    try:
        return asyncio.run(outputs())
    finally:
        serving.close()


def test_replicas_know_a_tenants_request_by_its_run_key_and_the_client_by_its_own_id_after_a_migration():
    prefill, dying, healthy = MockPrefill("prefill-0"), DyingDecode("decode-0", after=3), MockDecode("decode-1")
    request = ParsedRequest("r1", PROMPT, SamplingParams(max_tokens=10, temperature=0), 0, tenant="acme")
    outputs = serve([prefill], [dying, healthy], request)
    assert prefill.prefilled == ["acme/r1/1"] and dying.served == ["acme/r1/1"]
    assert healthy.served == ["acme/r1/1.m1"] and "acme/r1/1.m1" in healthy.aborted
    assert {o.request_id for o in outputs} == {"r1"} and outputs[-1].finished


def test_a_prefill_retry_runs_under_its_own_id_and_the_client_keeps_its_own():
    dead, healthy, decode = DyingPrefill("prefill-0"), MockPrefill("prefill-1"), MockDecode("decode-0")
    request = ParsedRequest("r1", PROMPT, SamplingParams(max_tokens=4, temperature=0), 0, tenant="acme")
    outputs = serve([dead, healthy], [decode], request)
    assert healthy.prefilled == ["acme/r1/1.p1"] and decode.served == ["acme/r1/1", "acme/r1/1.p1"]
    assert decode.aborted[0] == "acme/r1/1"  # the first reservation was dropped under the id it was made with
    assert {o.request_id for o in outputs} == {"r1"}
