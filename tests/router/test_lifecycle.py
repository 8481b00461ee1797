"""The router's request driver (router/lifecycle.py) over mock replicas: the disaggregated path, backpressure
(queueing, RESOURCE_EXHAUSTED), the fallback after a failed transfer, cancellation, colocated mode, and how each
failure maps to a gRPC status."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from tandem.engine.sampling_params import SamplingParams
from tandem.kv_transfer.descriptor import TransferState
from tandem.router.driver_settings import DriverSettings
from tandem.router.grpc_service import status_for
from tandem.router.lifecycle import RequestDriver
from tandem.router.mocks.replicas import MockDecode, MockPrefill, token_for
from tandem.router.replicas import NoCapacityError, NoReplicaError, Replica
from tandem.router.request_parsing import InvalidRequest, ParsedRequest

PROMPT = (5, 6, 7, 8)


def request(request_id="r1", max_tokens=5, n=1) -> ParsedRequest:
    return ParsedRequest(request_id, PROMPT, SamplingParams(max_tokens=max_tokens, temperature=0, n=n), 0)


def driver(prefill, decode, **settings) -> RequestDriver:
    return RequestDriver([Replica(p.name, "prefill", p) for p in prefill],
                         [Replica(d.name, "decode", d) for d in decode], DriverSettings(**settings))


async def collect(d: RequestDriver, req: ParsedRequest):
    return [p async for p in d.run(req)]


def tokens_of(progress) -> list[int]:
    return [t for p in progress for o in p.outputs for t in o.token_ids]


def test_disaggregated_request_runs_reserve_prefill_decode():
    prefill, decode = MockPrefill("prefill-0"), MockDecode("decode-0")
    progress = asyncio.run(collect(driver([prefill], [decode]), request()))
    assert tokens_of(progress) == [token_for(PROMPT, i) for i in range(5)]
    assert (progress[0].prefill_replica, progress[0].decode_replica) == ("prefill-0", "decode-0")
    assert progress[0].num_cached_tokens == 0  # a cold cache
    assert progress[0].prefill_route == "prefill_pool"
    assert prefill.prefilled == ["r1"]
    # the end of a request tells every replica it touched (a no-op where it finished)
    assert prefill.aborted == ["r1"] and decode.aborted == ["r1"]


def test_a_request_waits_for_room_then_runs():
    decode = MockDecode("decode-0", room=[False, False, False])
    d = driver([MockPrefill("prefill-0")], [decode], queue_timeout_s=5.0)
    progress = asyncio.run(collect(d, request()))
    assert len(tokens_of(progress)) == 5
    assert progress[0].queue_s > 0
    assert d.num_queued == 0


def test_no_room_within_the_queue_timeout_is_resource_exhausted():
    decode = MockDecode("decode-0", room=[False] * 1000)
    d = driver([MockPrefill("prefill-0")], [decode], queue_timeout_s=0.1)
    with pytest.raises(NoCapacityError, match="within 0.1 s") as failure:
        asyncio.run(collect(d, request()))
    assert status_for(failure.value)[0] is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert d.num_queued == 0


def test_a_full_queue_refuses_at_once():
    decode = MockDecode("decode-0", room=[False] * 1000)
    d = driver([MockPrefill("prefill-0")], [decode], max_queued_requests=0, queue_timeout_s=30)
    with pytest.raises(NoCapacityError, match="already queued"):
        asyncio.run(asyncio.wait_for(collect(d, request()), 5))


def test_a_replica_without_room_is_tried_after_the_others():
    full, free = MockDecode("decode-0", room=[False] * 1000), MockDecode("decode-1")
    d = driver([MockPrefill("prefill-0")], [full, free])
    for i in range(3):
        progress = asyncio.run(collect(d, request(f"r{i}")))
        assert progress[0].decode_replica == "decode-1"


def test_a_failed_transfer_falls_back_to_prefilling_on_a_decode_replica():
    prefill, decode = MockPrefill("prefill-0", fail=TransferState.FAILED), MockDecode("decode-0")
    d = driver([prefill], [decode])
    progress = asyncio.run(collect(d, request()))
    assert tokens_of(progress) == [token_for(PROMPT, i) for i in range(5)]
    assert {o.request_id for p in progress for o in p.outputs} == {"r1"}  # the client sees its own id
    assert d.num_fallbacks == 1
    assert sorted(decode.aborted) == ["r1", "r1.local"]


def test_n_above_one_and_colocated_mode_prefill_on_the_decode_replica():
    prefill, decode = MockPrefill("prefill-0"), MockDecode("decode-0")
    progress = asyncio.run(collect(driver([prefill], [decode]), request(n=2)))
    assert len(tokens_of(progress)) == 2 * 5 and prefill.prefilled == []  # two samples of 5 tokens
    assert progress[0].prefill_route == "n_gt_1"
    progress = asyncio.run(collect(driver([], [decode], mode="colocated"), request("c1")))
    assert (progress[0].prefill_replica, progress[0].decode_replica) == ("", "decode-0")
    assert progress[0].prefill_route == "colocated"


def test_cancelling_mid_stream_aborts_on_every_replica_touched():
    prefill, decode = MockPrefill("prefill-0"), MockDecode("decode-0", step_s=0.05)
    d = driver([prefill], [decode])

    async def cancel_after_two():
        seen = []

        async def consume():
            async for p in d.run(request(max_tokens=100)):
                seen.append(p)

        task = asyncio.create_task(consume())
        while len(seen) < 2:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return seen

    seen = asyncio.run(cancel_after_two())
    assert 2 <= len(seen) < 100
    assert prefill.aborted == ["r1"] and decode.aborted == ["r1"]
    assert all(r.load.in_flight == 0 for r in d.prefill + d.decode)


def test_an_empty_pool_is_unavailable():
    with pytest.raises(NoReplicaError) as failure:
        asyncio.run(collect(driver([MockPrefill("p")], []), request()))
    assert status_for(failure.value)[0] is grpc.StatusCode.UNAVAILABLE


def test_status_codes_for_each_failure():
    from ray.exceptions import RayActorError

    from tandem.engine.errors import RequestRejectedError

    assert status_for(InvalidRequest("x", "NOT_FOUND"))[0] is grpc.StatusCode.NOT_FOUND
    assert status_for(RequestRejectedError("too long"))[0] is grpc.StatusCode.INVALID_ARGUMENT
    assert status_for(RayActorError())[0] is grpc.StatusCode.UNAVAILABLE
    assert status_for(RuntimeError("bug"))[0] is grpc.StatusCode.INTERNAL


def test_cancelling_a_queued_request_leaves_the_queue_and_holds_nothing():
    decode = MockDecode("decode-0", room=[False] * 1000)
    prefill = MockPrefill("prefill-0")
    d = driver([prefill], [decode], queue_timeout_s=30)

    async def cancel_while_queued():
        task = asyncio.create_task(collect(d, request()))
        while d.num_queued == 0:
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_while_queued())
    assert d.num_queued == 0
    assert decode.reservations == {} and prefill.prefilled == []
    assert all(r.load.in_flight == 0 for r in d.prefill + d.decode)


def test_a_replica_that_dies_mid_stream_is_unavailable_without_migrations_and_no_longer_routed_to():
    """With max_migrations=0 (tests/router/test_migration.py covers the default, where the stream moves on)."""
    from tandem.router.mocks.replicas import DyingDecode
    from tandem.router.replicas import ReplicaLostError

    dying, healthy = DyingDecode("decode-0", after=2), MockDecode("decode-1")
    d = driver([MockPrefill("prefill-0")], [dying, healthy], max_migrations=0)
    seen = []

    async def run():
        async for p in d.run(request(max_tokens=10)):
            seen.append(p)

    with pytest.raises(ReplicaLostError, match="decode-0 died.*max_migrations=0") as failure:
        asyncio.run(run())
    assert status_for(failure.value)[0] is grpc.StatusCode.UNAVAILABLE
    assert len(seen) == 2 and d.lost == ["decode-0"]
    for i in range(3):  # later requests go to the live replica
        assert asyncio.run(collect(d, request(f"after-{i}")))[0].decode_replica == "decode-1"


def test_a_replica_found_dead_while_reserving_leaves_the_pool():
    from tandem.router.mocks.replicas import DyingDecode

    d = driver([MockPrefill("prefill-0")], [DyingDecode("decode-0", after=-1)])
    with pytest.raises(Exception, match="decode-0 died"):
        asyncio.run(collect(d, request()))
    with pytest.raises(NoReplicaError):
        asyncio.run(collect(d, request("r2")))


# -- late binding (DriverSettings.prefill_queue_tokens) ------------------------------------------------------------


def long_prompt(i: int) -> tuple[int, ...]:
    return tuple(range(1000 * (i + 1), 1000 * (i + 1) + 80))  # 80 tokens, no prefix shared with another i


def long_request(i: int) -> ParsedRequest:
    return ParsedRequest(f"late-{i}", long_prompt(i), SamplingParams(max_tokens=3, temperature=0), 0)


def test_late_binding_holds_no_decode_room_while_the_prefill_queue_is_long_and_a_new_replica_takes_the_backlog():
    slow = MockPrefill("prefill-0", step_s=0.05)
    decode = MockDecode("decode-0")
    d = driver([slow], [decode], prefill_queue_tokens=100)  # one 80-token prompt may queue behind another

    async def main():
        tasks = [asyncio.create_task(collect(d, long_request(i))) for i in range(6)]
        await asyncio.sleep(0.02)
        seen = (d.num_waiting_prefill, d.prefill_waiting_tokens, len(decode.reservations), d.num_queued)
        d.add(Replica("prefill-1", "prefill", fresh := MockPrefill("prefill-1", step_s=0.05)))
        results = await asyncio.gather(*tasks)
        return seen, results, fresh

    seen, results, fresh = asyncio.run(main())
    # two sent (80 < 100 queued before the second), four wait at the router holding nothing on the decode replica
    assert seen == (4, 4 * 80, 2, 0)
    for i, progress in enumerate(results):
        assert tokens_of(progress) == [token_for(long_prompt(i), k) for k in range(3)]
    assert fresh.prefilled, "the replica that joined took requests from the backlog"
    assert len(slow.prefilled) + len(fresh.prefilled) == 6
    assert (d.num_waiting_prefill, d.prefill_waiting_tokens, decode.reservations) == (0, 0, {})


def test_late_binding_waits_within_the_queue_timeout_and_the_queue_limit():
    d = driver([MockPrefill("prefill-0", step_s=0.5)], [MockDecode("decode-0")], prefill_queue_tokens=50,
               queue_timeout_s=0.1, max_queued_requests=1)

    async def main():
        first = asyncio.create_task(collect(d, long_request(0)))  # sent: the queue was empty
        await asyncio.sleep(0.01)
        waiting = asyncio.create_task(collect(d, long_request(1)))
        await asyncio.sleep(0.01)
        with pytest.raises(NoCapacityError, match="already waiting"):
            await collect(d, long_request(2))  # max_queued_requests=1 is taken by the one waiting
        with pytest.raises(NoCapacityError, match="fewer than 50 tokens queued within 0.1 s"):
            await waiting
        assert len(tokens_of(await first)) == 3

    asyncio.run(main())
    assert (d.num_waiting_prefill, d.prefill_waiting_tokens) == (0, 0)


@pytest.mark.parametrize("policy,chat_position", [("fcfs", 5), ("fair", 2)])
def test_the_waiting_room_wakes_in_the_prefill_pools_order(policy, chat_position):
    """One tenant's backlog waits in the room (its first request was sent at once); a second tenant's request
    comes after it. fcfs wakes it last; fair after the backlog's first waiting request only (both have start tag
    0, the virtual time; the backlog's later ones have 80, 160, 240: its tokens so far)."""
    from tandem.engine.engine_config import SchedulingConfig

    prefill = MockPrefill("prefill-0", step_s=0.03)
    d = driver([prefill], [MockDecode("decode-0")], prefill_queue_tokens=50,
               waiting_room=SchedulingConfig(policy=policy))

    def tenant_request(i: int, tenant: str) -> ParsedRequest:
        return ParsedRequest(f"{tenant}-{i}", long_prompt(i), SamplingParams(max_tokens=2, temperature=0), 0,
                             tenant=tenant)

    async def main():
        tasks = [asyncio.create_task(collect(d, tenant_request(i, "batch"))) for i in range(5)]
        await asyncio.sleep(0.01)  # the first is sent, four wait
        tasks.append(asyncio.create_task(collect(d, tenant_request(9, "chat"))))
        await asyncio.gather(*tasks)

    asyncio.run(main())
    assert [rid.partition("/")[0] for rid in prefill.prefilled].index("chat") == chat_position


@pytest.mark.parametrize("policy,order", [("fcfs", ["long", "short", "mid"]), ("sjf", ["short", "mid", "long"])])
def test_requests_waiting_for_decode_room_take_it_in_the_decode_pools_order(policy, order):
    """No decode replica has room for the three (each one's first round is refused); they wait in the decode
    pool's order, only the first asking again: fcfs by arrival, sjf by fewest max_tokens."""
    from tandem.engine.engine_config import SchedulingConfig

    decode = MockDecode("decode-0", room=[False, False, False])
    d = driver([MockPrefill("prefill-0")], [decode], decode_room=SchedulingConfig(policy=policy))

    def asking(rid: str, max_tokens: int) -> ParsedRequest:
        return ParsedRequest(rid, long_prompt(len(rid)), SamplingParams(max_tokens=max_tokens, temperature=0), 0)

    async def main():
        await asyncio.gather(*(collect(d, asking(rid, n)) for rid, n in (("long", 30), ("short", 5), ("mid", 15))))

    asyncio.run(main())
    assert decode.served == order
    assert d.num_queued == 0


def test_driver_settings_refuse_a_negative_prefill_queue():
    with pytest.raises(ValueError, match="prefill_queue_tokens"):
        DriverSettings(prefill_queue_tokens=-1)
