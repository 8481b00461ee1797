"""Admission under overload (router/admission.py) in the router: no leaked waiting count however a request ends;
and, through the router's real front doors over a batching mock replica of known capacity, a burst of 10x that
capacity: the excess refused at once (429 + Retry-After / RESOURCE_EXHAUSTED + retry-after), the admitted
requests starting within the SLO, and the router and the replica holding a bounded number of requests. The
controller itself, on a fake clock: test_admission_control.py."""

from __future__ import annotations

import asyncio
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import grpc
import httpx
import pytest

from tandem.engine.sampling_params import SamplingParams
from tandem.proto.v1 import tandem_pb2_grpc as pb_grpc
from tandem.router.admission import AtCapacity
from tandem.router.client import build_request
from tandem.router.grpc_service import TandemServicer, start_grpc_server
from tandem.router.http_service import build_app, start_http_server
from tandem.router.driver_settings import DriverSettings
from tandem.router.lifecycle import RequestDriver
from tandem.router.limits import AdmissionSettings, ServingLimits
from tandem.router.mocks.batching import BatchedDecode, StepCosts
from tandem.router.replicas import Replica
from tandem.router.request_parsing import ModelFacts, ParsedRequest
from tandem.router.serving import DeadlineExceeded, Serving

from tests.router.router_harness import MODEL, BackgroundLoop, model_facts


# --- Serving.run: the waiting count on every path ----------------------------------------------------------------


def parsed(request_id: str, max_tokens: int = 3) -> ParsedRequest:
    return ParsedRequest(request_id, (5, 6, 7, 8), SamplingParams(max_tokens=max_tokens, temperature=0), 0)


def serving_over(decode, **admission) -> Serving:
    driver = RequestDriver([], [Replica("decode-0", "decode", decode)], DriverSettings(mode="colocated"))
    limits = ServingLimits(admission=AdmissionSettings(**admission))
    return Serving(driver, ModelFacts(MODEL, None, 49152, 512), "colocated", limits=limits)


async def drain(serving: Serving, request: ParsedRequest, **kwargs) -> int:
    return len([step async for step in serving.run(request, time.monotonic(), "grpc", **kwargs)])


def test_no_waiting_request_leaks_on_success_error_cancel_deadline_or_refusal():
    async def scenario():
        slow = BatchedDecode("decode-0", StepCosts(step_s=0.2, max_num_seqs=1))
        serving = serving_over(slow, initial_waiting=2)
        try:
            assert await drain(serving, parsed("ok", max_tokens=1)) == 1
            assert serving.admission.waiting == 0

            task = asyncio.create_task(drain(serving, parsed("cancelled")))
            while serving.admission.waiting == 0:
                await asyncio.sleep(0.001)
            task.cancel()  # the client went away before its first token
            with pytest.raises(asyncio.CancelledError):
                await task
            assert serving.admission.waiting == 0

            with pytest.raises(DeadlineExceeded):
                await drain(serving, parsed("late"), deadline=time.monotonic() + 0.05)
            assert serving.admission.waiting == 0

            holders = [asyncio.create_task(drain(serving, parsed(f"h{i}"))) for i in range(2)]
            while serving.admission.waiting < 2:
                await asyncio.sleep(0.001)
            with pytest.raises(AtCapacity):  # refused before any replica call
                await drain(serving, parsed("refused"))
            assert not any(rid.startswith("refused/") for rid in slow.served)
            for holder in holders:
                holder.cancel()
            await asyncio.gather(*holders, return_exceptions=True)
            assert serving.admission.waiting == 0

            serving.driver.remove("decode-0")  # the driver's own error (no replica) ends it too
            with pytest.raises(Exception, match="no ready replica"):
                await drain(serving, parsed("orphan"))
            assert serving.admission.waiting == 0 and not serving.active
            registry = serving.metrics.registry
            assert registry.get_sample_value("tandem_admission_refusals_total", {"reason": "unmeasured"}) == 1
        finally:
            slow.loop.stop()
            serving.close()

    asyncio.run(scenario())


# --- a burst of 10x the capacity through the real front doors ----------------------------------------------------

STEP_S = 0.04
SLOTS = 2
MAX_TOKENS = 5  # a request holds a slot for 5 steps (its prefill step emits the first token): 0.2 s
CYCLE_S = MAX_TOKENS * STEP_S
RATE = SLOTS / CYCLE_S  # 10 starts per second
SLO_S = 2.0
CAPACITY = round(RATE * SLO_S)  # requests that can start within the SLO: 20
BURST = 10 * CAPACITY


class Front(BackgroundLoop):
    """Serving (colocated) over one BatchedDecode of known capacity, both APIs on loopback, SLO admission."""

    def __init__(self, *, initial_waiting: int = SLOTS):
        super().__init__()
        # The replica shares this process and its GIL with the router and the burst's client, which a real
        # replica's process does not: its step loop makes up any time they held it (catch_up_s), so its start
        # rate stays the one it was measured at, however busy the router was refusing the burst.
        costs = StepCosts(step_s=STEP_S, max_num_seqs=SLOTS, catch_up_s=10 * SLO_S)
        self.decode = BatchedDecode("decode-0", costs)
        facts = model_facts()
        self.peak = {"waiting": 0, "active": 0, "replica": 0}

        async def boot():
            driver = RequestDriver([], [Replica("decode-0", "decode", self.decode)], DriverSettings(mode="colocated"))
            limits = ServingLimits(admission=AdmissionSettings(mode="slo", ttft_slo_s=SLO_S, window_s=10,
                                                               initial_waiting=initial_waiting))
            self.serving = Serving(driver, facts, "colocated", limits=limits)
            self.http, http_port = await start_http_server(build_app(self.serving), "127.0.0.1:0")
            self.grpc, grpc_port, _ = await start_grpc_server(TandemServicer(self.serving), "127.0.0.1:0")
            self.sampler = asyncio.create_task(self._sample())
            return http_port, grpc_port

        http_port, grpc_port = self.run(boot())
        self.http_url, self.target = f"http://127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}"
        self.channel = grpc.insecure_channel(self.target)
        self.stub = pb_grpc.TandemStub(self.channel)

    async def _sample(self) -> None:
        """The most requests the router and the replica held at once."""
        while True:
            loop = self.decode.loop
            for key, value in (("waiting", self.serving.admission.waiting), ("active", len(self.serving.active)),
                               ("replica", len(loop.waiting) + len(loop.running))):
                self.peak[key] = max(self.peak[key], value)
            await asyncio.sleep(0.005)

    async def start_rate(self) -> float | None:
        return self.serving.admission.start_rate()

    async def held(self) -> dict:
        """What the router and the replica hold now (a failure's message)."""
        loop = self.decode.loop
        return {"waiting to start": self.serving.admission.waiting, "active": list(self.serving.active),
                "replica waiting": list(loop.waiting), "replica running": list(loop.running),
                "replica steps": loop.num_steps, "served": self.decode.served}

    def idle(self) -> bool:
        return self.run(self._idle())

    async def _idle(self) -> bool:
        loop = self.decode.loop
        return not (self.serving.admission.waiting or self.serving.active or loop.waiting or loop.running)

    def close(self) -> None:
        self.channel.close()

        async def stop():
            self.sampler.cancel()
            await self.http.stop()
            await self.grpc.stop(1)
            self.decode.loop.stop()
            self.serving.close()

        self.run(stop())
        self.stop()


async def generate_one(stub: pb_grpc.TandemStub) -> tuple[grpc.StatusCode, float, float | None, dict]:
    """(status, seconds from sending to the first response or the refusal, the router's own TTFT (arrival to
    first token, from the last response's timings), the refusal's trailing metadata)."""
    sent = time.monotonic()
    call = stub.Generate(build_request(prompt="Hello there", max_tokens=MAX_TOKENS, ignore_eos=True))
    first, last = None, None
    try:
        async for response in call:
            first = time.monotonic() - sent if first is None else first
            last = response
    except grpc.aio.AioRpcError as e:
        return e.code(), time.monotonic() - sent, None, dict(await call.trailing_metadata() or ())
    return grpc.StatusCode.OK, first, last.timings.ttft_s, {}


async def burst(target: str, count: int) -> list[tuple[grpc.StatusCode, float, float | None, dict]]:
    """count requests at once over one channel (HTTP/2 streams: no connection setup in the measurement)."""
    async with grpc.aio.insecure_channel(target) as channel:
        await channel.channel_ready()
        stub = pb_grpc.TandemStub(channel)
        return await asyncio.gather(*(generate_one(stub) for _ in range(count)))


async def warm_up(target: str, seconds: float, workers: int) -> None:
    """`workers` clients back to back for `seconds`: the replica is kept busy and its start rate measured."""
    end = time.monotonic() + seconds
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.TandemStub(channel)

        async def worker():
            while time.monotonic() < end:
                status, _, _, _ = await generate_one(stub)
                if status != grpc.StatusCode.OK:
                    await asyncio.sleep(0.05)
        await asyncio.gather(*(worker() for _ in range(workers)))


def wait_idle(front: Front, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not front.idle():
        assert time.monotonic() < deadline, "the router or the replica still holds requests"
        time.sleep(0.02)


@pytest.fixture
def front():
    f = Front()
    yield f
    f.close()


@dataclass
class BurstOutcome:
    """What a burst through a fresh Front saw: the start rate measured after the warm-up, each request's
    (status, seconds to its first response or refusal, router TTFT, refusal metadata), the most requests the
    router and the replica held, and /metrics once everything ended."""

    measured: float
    results: list[tuple[grpc.StatusCode, float, float | None, dict]]
    peak: dict[str, int]
    metrics: str


def run_burst() -> BurstOutcome:
    """Warms a fresh Front up, measures its start rate, then sends BURST requests at once. Runs in a process of
    its own (spawned by the test): a thousand tests before it leave this process holding millions of objects,
    and one full garbage collection of them once held the router's loop for 7-13 s in the middle of the burst (a
    router the control plane starts freezes its start-up heap instead: tests/router/test_gc_pauses.py)."""
    front = Front()
    try:
        asyncio.run(warm_up(front.target, 2.5, 3 * SLOTS))
        wait_idle(front)
        measured = front.run(front.start_rate())
        front.peak.update(waiting=0, active=0, replica=0)
        results = asyncio.run(burst(front.target, BURST))
        peak = dict(front.peak)
        wait_idle(front)
        return BurstOutcome(measured, results, peak, httpx.get(f"{front.http_url}/metrics").text)
    finally:
        front.close()


def test_a_burst_of_ten_times_capacity_is_refused_at_once_and_the_admitted_meet_the_slo():
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        outcome = pool.submit(run_burst).result(timeout=180)
    assert RATE * 0.6 < outcome.measured < RATE * 1.6, outcome.measured

    admitted = [r for r in outcome.results if r[0] == grpc.StatusCode.OK]
    refused = [r for r in outcome.results if r[0] != grpc.StatusCode.OK]
    assert CAPACITY // 2 <= len(admitted) <= 2 * CAPACITY, len(admitted)
    for status, seconds, _, metadata in refused:
        assert status == grpc.StatusCode.RESOURCE_EXHAUSTED and seconds < 1.0, (status, seconds)
        assert int(metadata["retry-after"]) >= 1
    # The controller assumes a steady flow of starts; the replica starts SLOTS at a time once per slot cycle,
    # so one may start up to a cycle later than that flow would start it. And the measured rate runs a few
    # percent high (the window also holds the warm-up's first steps, when free slots started requests at once).
    # So: the SLO, plus 10% of it, plus one cycle (seen: about 2.16 s against 2.4).
    ttfts = sorted(ttft for _, _, ttft, _ in admitted)
    assert ttfts[-1] < SLO_S * 1.1 + CYCLE_S, (len(admitted), ttfts)
    # What the router and the replica held stayed near the capacity, nowhere near the burst.
    peak = outcome.peak
    assert peak["waiting"] <= 2 * CAPACITY and peak["active"] <= 2 * CAPACITY + SLOTS, peak
    assert peak["replica"] <= 2 * CAPACITY + SLOTS, peak
    assert f'tandem_admission_refusals_total{{reason="slo"}} {len(refused)}.0' in outcome.metrics
    assert "tandem_requests_waiting_to_start 0.0" in outcome.metrics


def test_refusals_carry_retry_after_on_both_apis(front):
    async def hold():  # SLOTS requests wait to start: the prior's limit, as nothing has been measured yet
        return [front.serving.admission.admit() for _ in range(SLOTS)]

    tickets = front.run(hold())
    sent = time.monotonic()
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    reply = httpx.post(f"{front.http_url}/v1/completions", json=body, timeout=10)
    assert reply.status_code == 429 and reply.headers["retry-after"] == "1"
    error = reply.json()["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == "resource_exhausted"
    assert error["message"] == (f"the cluster is at capacity: {SLOTS} requests are waiting to start and no start "
                                f"rate has been measured yet (at most {SLOTS} may wait until one is); retry in 1 s")
    with pytest.raises(grpc.RpcError) as caught:
        list(front.stub.Generate(build_request(prompt="Hi", max_tokens=2), timeout=10))
    assert time.monotonic() - sent < 5.0  # at once: a refusal that waited for a slot would wait out the 10 s
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert caught.value.details() == error["message"]
    metadata = dict(caught.value.trailing_metadata())
    assert metadata["retry-after"] == "1" and metadata["grpc-retry-pushback-ms"] == "1000"
    assert front.decode.served == []  # no replica saw either

    async def release():
        for ticket in tickets:
            ticket.close()

    front.run(release())
    # Served again once nothing waits (0.13-0.16 s here). One full CI run once timed out at 10 s on this request,
    # not reproduced alone nor beside 4 busy processes: the wait is 60 s, and a timeout names what was held.
    try:
        assert httpx.post(f"{front.http_url}/v1/completions", json=body, timeout=60).status_code == 200
    except httpx.TimeoutException:
        pytest.fail(f"no answer in 60 s once the slots were free: {front.run(front.held())}")
    wait_idle(front)
