"""bench/disagg_scale.py: the deployments it builds, the load generator's Backend over the router's in-process
request driver (records filled as the gRPC backend fills them, failures recorded, never raised), and a small
calibration on the real embedded model."""

from __future__ import annotations

import asyncio

import pytest

from tandem.bench.disagg_scale import _linear_fit, build_deployment, calibrate
from tandem.cluster.simulation import DriverBackend, run_feed
from tandem.bench.loadgen.arrivals import RealClock
from tandem.bench.loadgen.records import RequestRecord, WorkRequest
from tandem.bench.loadgen.runner import open_loop
from tandem.bench.loadgen.workloads import Conversation
from tandem.router.driver_settings import DriverSettings
from tandem.router.mocks.batching import BatchedDecode, BatchedPrefill, StepCosts

COSTS = StepCosts(step_s=0.002, decode_token_s=0.0001, prefill_token_s=0.00002, max_num_batched_tokens=256,
                  kv_bytes_per_token=1000, transfer_bytes_per_s=1e8)
TIMINGS = {"ttft_s", "mean_itl_s", "e2e_s", "queue_s", "prefill_s", "transfer_s", "admission_s"}


def prompt(n: int, seed: int) -> tuple[int, ...]:
    return tuple(1000 + (seed * 7919 + i * 31) % 20000 for i in range(n))


def test_the_deployments_have_the_same_engines():
    disaggregated = build_deployment("disaggregated", 8, COSTS)
    colocated = build_deployment("colocated", 8, COSTS, "round_robin")
    assert [type(r) for r in disaggregated.replicas] == [BatchedPrefill] * 8 + [BatchedDecode] * 8
    assert (len(disaggregated.driver.prefill), len(disaggregated.driver.decode)) == (8, 8)
    assert [type(r) for r in colocated.replicas] == [BatchedDecode] * 16 and not colocated.driver.prefill
    assert colocated.driver.settings.mode == "colocated"
    assert colocated.driver.settings.routing.policy == "round_robin"
    with pytest.raises(ValueError, match="mode"):
        build_deployment("split", 8, COSTS)
    with pytest.raises(ValueError, match="replicas_per_pool"):
        build_deployment("colocated", 0, COSTS)


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_driver_backend_fills_records(mode):
    async def main():
        async with run_feed(build_deployment(mode, 2, COSTS)) as deployment:
            backend, clock = DriverBackend(deployment.driver), RealClock()
            requests = [WorkRequest(max_tokens=4 + i, prompt_ids=prompt(200 + 10 * i, i)) for i in range(6)]
            records = [RequestRecord(i, clock.now(), max_tokens=r.max_tokens) for i, r in enumerate(requests)]
            texts = await asyncio.gather(*(backend.send(r, rec, clock) for r, rec in zip(requests, records)))
            # The same prompt again: its full blocks are cached where it went (cache-aware prefill routing).
            again = RequestRecord(6, clock.now())
            await backend.send(requests[0], again, clock)
        for request, record, text in zip(requests, records, texts):
            assert record.ok, record.error_message
            assert record.sent_s <= record.first_token_s <= record.token_times_s[-1] <= record.end_s
            assert sum(record.token_counts) == record.output_tokens == request.max_tokens
            assert record.prompt_tokens == len(request.prompt_ids) and record.cached_tokens == 0
            assert set(record.server_timings) == TIMINGS
            assert record.server_timings["ttft_s"] >= COSTS.step_s
            assert text.count("<") == request.max_tokens  # the mock's text: <token> per token
        assert again.ok and sum(again.token_counts) == 4
        if mode == "disaggregated":
            assert again.cached_tokens == 192
            assert all(r.server_timings["prefill_s"] > 0 for r in records)
            # the mock moves the KV when decode() starts: the router sees it as the decode replica's admission
            for request, r in zip(requests, records):
                assert r.server_timings["admission_s"] >= COSTS.transfer_time(len(request.prompt_ids))
                assert r.server_timings["admission_s"] < r.server_timings["prefill_s"]
        else:
            assert all(r.server_timings["admission_s"] == r.server_timings["transfer_s"] == 0 for r in records)
        for replica in deployment.replicas:
            assert (await replica.stats()).running == 0

    asyncio.run(main())


def test_driver_backend_records_failures_instead_of_raising():
    tight = StepCosts(step_s=0.002, max_num_seqs=1)

    async def main():
        deployment = build_deployment("disaggregated", 1, tight, settings=DriverSettings(queue_timeout_s=0.05))
        async with run_feed(deployment):
            backend, clock = DriverBackend(deployment.driver), RealClock()
            text_only = RequestRecord(0, 0.0)
            assert await backend.send(WorkRequest(max_tokens=4, text="hello"), text_only, clock) == ""
            # One decode sequence at a time: the second request finds no room within the queue's timeout.
            records = [RequestRecord(i, 0.0) for i in (1, 2)]
            await asyncio.gather(*(backend.send(WorkRequest(max_tokens=200, prompt_ids=prompt(32, i)), r, clock)
                                   for i, r in enumerate(records)))
        assert text_only.error == "INVALID_ARGUMENT" and "prompt_ids" in text_only.error_message
        assert not text_only.ok
        assert sorted(r.error or "ok" for r in records) == ["RESOURCE_EXHAUSTED", "ok"]

    asyncio.run(main())


def test_the_load_generator_runs_over_it():
    conversations = [Conversation(0.01 * i, (WorkRequest(max_tokens=3, prompt_ids=prompt(64, i)),))
                     for i in range(10)]

    async def main():
        async with run_feed(build_deployment("colocated", 2, COSTS)) as deployment:
            return await open_loop(conversations, DriverBackend(deployment.driver), quiet=True)

    records = asyncio.run(main())
    assert len(records) == 10 and all(r.ok and r.output_tokens == 3 for r in records)


def test_linear_fit():
    assert _linear_fit([1, 4, 16], [0.03, 0.06, 0.18]) == pytest.approx((0.02, 0.01))


def test_calibrate_small(embedded):
    """A small form of the calibration (short prompts, two batch sizes): costs come out positive and plausible,
    and the KV size is the embedded model's (30 layers x 3 KV heads x 64 dims, K and V, float32)."""
    costs = calibrate(prompt_tokens=64, batch_sizes=(1, 2), decode_context=8, decode_steps=2, repeats=1,
                      max_num_batched_tokens=512, loaded=embedded)
    assert costs.kv_bytes_per_token == 2 * 30 * 3 * 64 * 4
    assert costs.step_s + costs.decode_token_s > 0 and costs.prefill_token_s > 0
    assert costs.step_s < 5 and costs.prefill_token_s < 1
    assert (costs.max_num_batched_tokens, costs.transfer_bytes_per_s) == (512, 1.7e9)
