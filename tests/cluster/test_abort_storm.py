"""An abort storm (SGLang's failures went to 89% under one and took over an hour to recover): during steady load
on the disaggregated cluster of deploy/manifests/local.yaml (a prefill and a decode replica, the embedded
model), STORM requests are started and cancelled by their clients within STORM_S seconds, at random points of
their lives (before their prefill, during it, while decoding). Afterwards: no request of the steady load failed
and each gave its greedy tokens, the steady load's completion rate is back to its pre-storm level 5 s after the storm,
and no replica holds a request or a KV block (every block freed, bookkeeping consistent). The rates are counted
over WINDOW_S: at about 1 completion a second on a slow machine, a shorter window counts too few to compare.

The storm's requests that wait for their first token are real load: on a slow machine (about 3 starts a second on
one CI machine) they fill the queue past what starts within the queue timeout, and admission then refuses new
requests, the steady load's too, with RESOURCE_EXHAUSTED and a Retry-After. That is load shedding, not a failure,
so the steady clients do what a well-behaved client does (wait the Retry-After, send again); a refusal must come
before the storm's end (once its requests are gone, none of them may still count as waiting), and the recovery is
measured from when the last refused client is back."""

from __future__ import annotations

import asyncio
import random
import time

import grpc
import pytest

from tandem.proto.v1 import tandem_pb2_grpc as pb_grpc
from tandem.router.client import build_request
from tests.cluster.ray_cluster import QUESTIONS, chat, check_integrity, manifest_for_test, running, simulated_cluster
from tests.cluster.ray_cluster import wait_idle

STORM = 1000
STORM_S = 10.0
STEADY_CLIENTS = 3
STEADY_TOKENS = 12
WINDOW_S = 10.0
RECOVERY_S = 5.0  # from the storm's end (or the last refused client's return) to the recovery's window


@pytest.fixture(scope="module")
def cluster():
    with simulated_cluster():
        with running(manifest_for_test("local.yaml")) as tandem:
            yield tandem


async def steady_client(stub, index: int, stop: asyncio.Event, done: list, failures: list,
                        refusals: list) -> None:
    """Greedy requests one after another; each completion's (end time, question, tokens) goes to done. A refusal
    at capacity ((its time, its Retry-After) goes to refusals) is sent again after its Retry-After; any other
    error is a failure."""
    turn = 0
    while not stop.is_set():
        question = QUESTIONS[(index + turn) % len(QUESTIONS)]
        tokens = []
        try:
            async for response in stub.Generate(build_request(chat=chat(question), max_tokens=STEADY_TOKENS,
                                                              temperature=0, ignore_eos=True)):
                tokens.extend(response.token_ids)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and not tokens:
                retry_after = float(dict(e.trailing_metadata() or ())["retry-after"])
                refusals.append((time.monotonic(), retry_after))
                await asyncio.sleep(retry_after)
                continue  # the same question again
            failures.append((question, e.code(), e.details()))
        else:
            done.append((time.monotonic(), question, tuple(tokens)))
        turn += 1


async def storm_request(stub, rng: random.Random, outcomes: list) -> None:
    """One request its client cancels at a random point: at once, after 0-1.5 s, or after its first token."""
    call = stub.Generate(build_request(chat=chat(rng.choice(QUESTIONS)), max_tokens=64, temperature=0.7,
                                       seed=rng.randrange(1 << 30)))
    how = rng.choice(("now", "later", "first_token"))
    if how == "later":
        await asyncio.sleep(rng.uniform(0, 1.5))
    try:
        if how == "first_token":
            async for _ in call:
                break
        call.cancel()
        await call.code()
        outcomes.append(how)
    except grpc.aio.AioRpcError as e:  # refused before the cancel (e.g. at capacity): the storm may be refused
        outcomes.append(e.code().name)


def rate(done: list, start: float, end: float) -> float:
    return sum(start <= t < end for t, _, _ in done) / (end - start)


def test_an_abort_storm_under_steady_load_fails_nothing_else_recovers_and_leaks_nothing(cluster):
    async def scenario():
        async with grpc.aio.insecure_channel(cluster.endpoint) as channel:
            stub = pb_grpc.TandemStub(channel)
            stop, done, failures, refusals, outcomes = asyncio.Event(), [], [], [], []
            steady = [asyncio.create_task(steady_client(stub, i, stop, done, failures, refusals))
                      for i in range(STEADY_CLIENTS)]
            await asyncio.sleep(2.0)  # warm
            before_start = time.monotonic()
            await asyncio.sleep(WINDOW_S)
            storm_start = time.monotonic()
            rng = random.Random(0)
            storm = []
            for i in range(STORM):
                storm.append(asyncio.create_task(storm_request(stub, rng, outcomes)))
                await asyncio.sleep(max(0.0, storm_start + (i + 1) * STORM_S / STORM - time.monotonic()))
            await asyncio.gather(*storm)
            storm_end = time.monotonic()
            back = max([storm_end] + [t + retry_after for t, retry_after in refusals])
            await asyncio.sleep(back + RECOVERY_S + WINDOW_S - time.monotonic())
            stop.set()
            await asyncio.gather(*steady)
            return done, failures, refusals, outcomes, (before_start, storm_start, storm_end, back)

    done, failures, refusals, outcomes, (before_start, storm_start, storm_end, back) = asyncio.run(scenario())
    assert not failures, failures[:3]
    assert all(storm_start <= t <= storm_end for t, _ in refusals), [t - storm_end for t, _ in refusals]
    assert len(outcomes) == STORM
    before = rate(done, before_start, storm_start)
    recovered = rate(done, back + RECOVERY_S, back + RECOVERY_S + WINDOW_S)
    during = rate(done, storm_start, storm_end)
    print(f"steady completions/s: before {before:.2f}, during the storm {during:.2f}, recovered {recovered:.2f}; "
          f"storm outcomes {dict((o, outcomes.count(o)) for o in set(outcomes))}; steady refusals {len(refusals)}; "
          f"storm took {storm_end - storm_start:.1f} s")
    assert before > 0 and recovered >= 0.6 * before, (before, recovered)
    greedy = {}
    for _, question, tokens in done:  # every steady run of a question gave the same greedy tokens
        assert greedy.setdefault(question, tokens) == tokens, question
    wait_idle(cluster)
    check_integrity(cluster)
