"""The batching mock replicas (router/mocks/batching.py): one step loop per replica, so a colocated replica's
prompt chunks stall its running decodes while a disaggregated decode replica's do not; timings follow StepCosts;
aborts and cancellations free what they held; the router's real request driver runs over them in both modes."""

from __future__ import annotations

import asyncio
import statistics
import time

import pytest

from tandem.engine.sampling_params import SamplingParams
from tandem.kv_transfer.descriptor import TransferState
from tandem.replica.contract import RequestAbortedError
from tandem.router.driver_settings import DriverSettings
from tandem.router.lifecycle import RequestDriver
from tandem.router.mocks.batching import BatchedDecode, BatchedPrefill, StepCosts, StepLoop, _Seq
from tandem.router.mocks.replicas import token_for
from tandem.router.replicas import Replica
from tandem.router.request_parsing import ParsedRequest

# A chunk next to one decode is 63 prompt tokens: 12.6 ms on top of a 5.2 ms decode step.
COSTS = StepCosts(step_s=0.005, decode_token_s=0.0002, prefill_token_s=0.0002, max_num_batched_tokens=64)
LONG = 63 * 12  # a prompt of 12 chunks beside one decode
A_TOKENS = 80  # the decoding request's: it outlasts LONG's prefill (about 40 of its tokens)


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def prompt(n: int, seed: int = 0) -> tuple[int, ...]:
    return tuple(100 + (seed * 7919 + i * 31) % 20000 for i in range(n))


def gaps(times: list[float], lo: int, hi: int) -> float:
    """Median gap between tokens lo..hi (indices into times)."""
    return statistics.median(b - a for a, b in zip(times[lo:hi], times[lo + 1:hi + 1]))


async def idle(replica) -> None:
    """Asserts the replica holds nothing and its step loop no longer steps (once a step in flight has ended)."""
    stats = await replica.stats()
    assert (stats.running, stats.waiting, stats.waiting_for_kv, stats.kv_blocks_in_use) == (0, 0, 0, 0)
    await asyncio.sleep(0.05)
    steps = replica.loop.num_steps
    await asyncio.sleep(0.03)
    assert replica.loop.num_steps == steps
    await replica.check_integrity()


async def disaggregated(prefill: BatchedPrefill, decode: BatchedDecode, rid: str, ids, max_tokens: int):
    """reserve -> prefill -> decode, as the request driver calls them."""
    descriptor = await decode.reserve(rid, ids, params(max_tokens))
    result = await prefill.prefill(rid, ids, params(max_tokens), descriptor)
    async for batch in decode.decode(rid, result.first_token):
        yield batch


async def stall_test(stream_a, stream_b) -> tuple[float, float, float]:
    """Runs request A; once it has 10 tokens starts B (a LONG prompt, 2 tokens). Returns A's median gaps
    before B, while B prefilled (up to B's first token) and after B finished."""
    times: list[float] = []
    b_first: list[int] = []

    async def run_a():
        async for batch in stream_a:
            times.extend(time.perf_counter() for _ in batch)

    async def run_b():
        async for _ in stream_b:
            b_first.append(len(times))

    task = asyncio.create_task(run_a())
    while len(times) < 10:
        await asyncio.sleep(0.001)
    start = len(times)
    await run_b()
    await task
    assert len(times) == A_TOKENS and b_first[1] + 3 < A_TOKENS
    return (gaps(times, 1, start - 1), gaps(times, start + 1, b_first[0] - 1),
            gaps(times, b_first[1] + 1, A_TOKENS - 1))


def test_a_colocated_prompt_chunks_stall_every_running_decode():
    async def main():
        d = BatchedDecode("d", COSTS)
        before, during, after = await stall_test(d.generate("a", prompt(16), params(A_TOKENS)),
                                                 d.generate("b", prompt(LONG, 1), params(2)))
        chunk = COSTS.prefill_token_s * 63
        assert during - before == pytest.approx(chunk, abs=0.003)
        assert after == pytest.approx(before, abs=0.0015)
        await idle(d)

    asyncio.run(main())


def test_b_disaggregated_decodes_do_not_see_the_prefill_pool():
    async def main():
        p, d = BatchedPrefill("p", COSTS), BatchedDecode("d", COSTS)
        before, during, after = await stall_test(disaggregated(p, d, "a", prompt(16), A_TOKENS),
                                                 disaggregated(p, d, "b", prompt(LONG, 1), 2))
        assert during == pytest.approx(before, abs=0.0015)
        assert after == pytest.approx(before, abs=0.0015)
        assert p.loop.num_steps == 1 + -(-LONG // 64)  # a's prompt, then b's in full 64-token chunks
        await idle(p)
        await idle(d)

    asyncio.run(main())


def test_step_order_decodes_first_then_chunks_first_come_first_served():
    loop = StepLoop(StepCosts(max_num_batched_tokens=100, max_num_seqs=3), lambda s: setattr(s, "to_prefill", 70),
                    lambda s: True)
    decoding, partial = _Seq("dec", (1,), params(4), None), _Seq("part", (1,) * 90, params(4), None, to_prefill=40)
    loop.running = {"dec": decoding, "part": partial}
    loop.waiting = {"w1": _Seq("w1", (1,), params(4), None), "w2": _Seq("w2", (1,), params(4), None)}
    decodes, chunks = loop.schedule()
    assert decodes == [decoding]
    assert [(s.request_id, n) for s, n in chunks] == [("part", 40), ("w1", 59)]
    assert list(loop.running) == ["dec", "part", "w1"] and list(loop.waiting) == ["w2"]  # max_num_seqs: 3


def test_c_first_token_timing_and_token_counts():
    costs = StepCosts(step_s=0.01, prefill_token_s=0.0001, max_num_batched_tokens=64, kv_bytes_per_token=500,
                      transfer_bytes_per_s=1e6)
    ids = prompt(200)  # chunks of 64, 64, 64, 8

    async def timed(stream):
        start, first, outputs = time.perf_counter(), None, []
        async for batch in stream:
            first = first or time.perf_counter() - start
            outputs += batch
        return first, outputs

    async def main():
        d = BatchedDecode("d", costs)
        ttft, outputs = await timed(d.generate("a", ids, params(5)))
        expected = 4 * costs.step_s + 200 * costs.prefill_token_s
        assert expected - 0.002 <= ttft < expected + 0.08  # above: the machine's lateness, which a busy one adds
        assert [o.token_ids[0] for o in outputs] == [token_for(ids, i) for i in range(5)]
        assert [o.finished for o in outputs] == [False] * 4 + [True] and outputs[0].num_cached_tokens == 0
        assert d.loop.num_steps == 4 + 4  # the prefill's steps, then one step per later token
        # The same prompt again: its 12 full blocks are cached, 8 tokens are computed in one step.
        ttft, outputs = await timed(d.generate("b", ids, params(1)))
        # one step of 8 tokens; all 200 again would take >= 6 steps' time
        assert ttft < 3.5 * costs.step_s and outputs[0].num_cached_tokens == 192 and len(outputs) == 1

        p, d = BatchedPrefill("p", costs), BatchedDecode("d2", costs)
        ttft, outputs = await timed(disaggregated(p, d, "c", ids, 6))
        transfer = costs.transfer_time(200)
        assert transfer == pytest.approx(0.1)
        assert expected + transfer - 0.002 <= ttft < expected + transfer + 0.08
        assert [o.token_ids[0] for o in outputs] == [token_for(ids, i) for i in range(6)]
        assert outputs[-1].finished and d.loop.num_steps == 5  # the first token came with the transfer
        for replica in (p, d):
            await idle(replica)

    asyncio.run(main())


async def consume(stream, tokens: list):
    async for batch in stream:
        tokens += batch


async def until(condition) -> None:
    for _ in range(2000):
        if condition():
            return
        await asyncio.sleep(0.001)
    raise AssertionError("condition never held")


@pytest.mark.parametrize("when", ["prefill", "decode"])
def test_d_abort_or_cancel_colocated_frees_the_sequence(when):
    async def main():
        d = BatchedDecode("d", COSTS)
        for how in ("abort", "cancel"):
            tokens, steps = [], d.loop.num_steps
            task = asyncio.create_task(consume(d.generate(how, prompt(64 * 20), params(1000)), tokens))
            await until(lambda: d.loop.num_steps >= steps + 3 if when == "prefill" else len(tokens) >= 3)
            assert d.loop.running
            if how == "abort":
                await d.abort(how)
                with pytest.raises(RequestAbortedError):
                    await task
                with pytest.raises(RequestAbortedError):  # a later call for an aborted id is refused
                    await consume(d.generate(how, prompt(8), params(2)), [])
            else:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            assert (len(tokens) == 0) == (when == "prefill")
            await idle(d)

    asyncio.run(main())


def test_d_abort_or_cancel_disaggregated_frees_everything():
    costs = StepCosts(step_s=0.005, prefill_token_s=0.0002, max_num_batched_tokens=64, kv_bytes_per_token=1000,
                      transfer_bytes_per_s=1e5)  # 16 tokens' transfer: 0.16 s

    async def main():
        p, d = BatchedPrefill("p", costs), BatchedDecode("d", costs)
        # Mid-prefill, on the prefill replica.
        descriptor = await d.reserve("a", prompt(640), params(4))
        task = asyncio.create_task(p.prefill("a", prompt(640), params(4), descriptor))
        await until(lambda: p.loop.num_steps >= 2)
        await asyncio.gather(p.abort("a"), d.abort("a"))
        with pytest.raises(RequestAbortedError):
            await task
        descriptor = await d.reserve("b", prompt(640), params(4))
        task = asyncio.create_task(p.prefill("b", prompt(640), params(4), descriptor))
        await until(lambda: p.loop.num_steps >= 4)
        task.cancel()
        await d.abort("b")
        await asyncio.gather(task, return_exceptions=True)
        # While the KV is on its way, and mid-decode.
        for rid, wait in (("c", lambda: d.transferring), ("e", lambda: len(tokens) >= 3)):
            tokens = []
            task = asyncio.create_task(consume(disaggregated(p, d, rid, prompt(16), 1000), tokens))
            await until(wait)
            await d.abort(rid)
            with pytest.raises(RequestAbortedError):
                await task
        tokens = []
        task = asyncio.create_task(consume(disaggregated(p, d, "f", prompt(16), 1000), tokens))
        await until(lambda: len(tokens) >= 3)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert not d.reservations and not d.transferring
        for replica in (p, d):
            await idle(replica)

    asyncio.run(main())


@pytest.mark.parametrize("mode", ["colocated", "disaggregated", "fallback"])
def test_e_the_request_driver_end_to_end(mode):
    costs = StepCosts(step_s=0.002, decode_token_s=0.0001, prefill_token_s=0.00002, max_num_batched_tokens=128,
                      kv_bytes_per_token=100, transfer_bytes_per_s=1e8)
    fail = TransferState.FAILED if mode == "fallback" else None
    prefill = [] if mode == "colocated" else [BatchedPrefill(f"p{i}", costs, fail=fail) for i in range(2)]
    decode = [BatchedDecode(f"d{i}", costs) for i in range(2 if prefill else 4)]
    driver = RequestDriver([Replica(p.name, "prefill", p) for p in prefill],
                           [Replica(d.name, "decode", d) for d in decode],
                           DriverSettings(mode="colocated" if mode == "colocated" else "disaggregated"),
                           block_size=16)

    async def one(i: int) -> tuple[list, str]:
        outputs, route = [], ""
        ids = prompt(300 + 40 * i, seed=i)
        async for progress in driver.run(ParsedRequest(f"r{i}", ids, params(5 + i), 0)):
            route = route or progress.prefill_route
            outputs += progress.outputs
        assert [o.token_ids[0] for o in outputs] == [token_for(ids, j) for j in range(5 + i)]
        assert outputs[-1].finished and all(o.request_id == f"r{i}" for o in outputs)
        return outputs, route

    async def main():
        feed = asyncio.create_task(driver.feed.run(driver.replicas, 0.01))
        results = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(8))), 20)
        feed.cancel()
        routes = {route for _, route in results}
        assert routes == {{"colocated": "colocated", "disaggregated": "prefill_pool",
                           "fallback": "transfer_failed"}[mode]}
        if mode == "disaggregated":
            assert sum(len(p.prefilled) for p in prefill) == 8 and driver.num_fallbacks == 0
        assert sum(len(d.served) for d in decode) == (16 if mode == "fallback" else 8)
        for replica in prefill + decode:
            await idle(replica)
            await replica.shutdown()

    asyncio.run(main())
