"""A deployment simulated in one process: the router's real request driver, routing and KV feed over the batching
mock replicas (router/mocks/batching.py), each pool priced by its own StepCosts (a profile's, cluster/
hardware_profile.py), loaded by the load generator (bench/loadgen) on the event loop's clock. On a virtual-time loop
(cluster/virtual_time.py) minutes of load take as long as their computation and the result does not depend on the
machine that runs it: `tandem plan` (cluster/planner.py) predicts deployments with it, and bench/disagg_scale.py
compares deployments at scale.

    shape = Shape("disaggregated", prefill=2, decode=6)
    summary = simulate(shape, {"prefill": costs_p, "decode": costs_d}, conversations, slo)
"""

from __future__ import annotations

import asyncio
import itertools
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from typing import AsyncIterator, Callable, Mapping, NamedTuple, Sequence

from tandem.bench.loadgen.records import Clock, RequestRecord, WorkRequest
from tandem.bench.loadgen.runner import open_loop
from tandem.bench.loadgen.stats import SLO, summarize
from tandem.bench.loadgen.workloads import Conversation
from tandem.cluster.virtual_time import run_virtual
from tandem.engine.sampling_params import SamplingParams
from tandem.router.accounting import Accounting
from tandem.router.driver_settings import DriverSettings
from tandem.router.lifecycle import RequestDriver
from tandem.router.mocks.batching import BLOCK_SIZE, BatchedDecode, BatchedPrefill, StepCosts
from tandem.router.replicas import Replica
from tandem.router.request_parsing import ParsedRequest
from tandem.router.serving import error_code

MODES = ("disaggregated", "colocated")


@dataclass(frozen=True)
class Shape:
    """How many replicas each pool runs: disaggregated, `prefill` prefill and `decode` decode replicas; colocated,
    `decode` replicas that prefill their own prompts (prefill 0)."""

    mode: str
    prefill: int
    decode: int

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        disaggregated = self.mode == "disaggregated"
        if self.decode < 1 or (self.prefill < 1 if disaggregated else self.prefill != 0):
            need = "a replica in each pool" if disaggregated else "decode replicas and no prefill pool"
            raise ValueError(f"a {self.mode} shape needs {need}, got prefill={self.prefill}, decode={self.decode}")

    def describe(self) -> str:
        if self.mode == "colocated":
            return f"colocated x{self.decode}"
        return f"disaggregated {self.prefill}P:{self.decode}D"


class Deployment(NamedTuple):
    """driver: the router's request driver over the replicas (driver.settings.mode says which deployment).
    start_feed(): starts the router's KV feed (polling every replica's KV events and free blocks) as a task on the
    running loop; cancel it when done (run_feed does)."""

    driver: RequestDriver
    replicas: list[BatchedPrefill | BatchedDecode]
    start_feed: Callable[[], asyncio.Task]


def build(shape: Shape, costs: Mapping[str, StepCosts], settings: DriverSettings | None = None) -> Deployment:
    """The shape's replicas, priced by costs[pool] ("prefill", "decode"; a colocated shape needs only "decode"),
    behind a request driver with `settings` (default DriverSettings(); its mode is replaced by the shape's)."""
    settings = DriverSettings(**{**vars(settings or DriverSettings()), "mode": shape.mode})
    prefill = [BatchedPrefill(f"prefill-{i}", costs["prefill"]) for i in range(shape.prefill)]
    name = "decode" if shape.mode == "disaggregated" else "colocated"
    decode = [BatchedDecode(f"{name}-{i}", costs["decode"]) for i in range(shape.decode)]
    driver = RequestDriver([Replica(r.name, "prefill", r) for r in prefill],
                           [Replica(r.name, "decode", r) for r in decode], settings, block_size=BLOCK_SIZE)

    def start_feed() -> asyncio.Task:
        return asyncio.get_running_loop().create_task(driver.feed.run(driver.replicas,
                                                                      settings.kv_events_interval_s))

    return Deployment(driver, [*prefill, *decode], start_feed)


@asynccontextmanager
async def run_feed(deployment: Deployment) -> AsyncIterator[Deployment]:
    """Runs the deployment's KV feed for the duration of the block; on leaving, stops it and every replica's
    step loop (the replicas are then done: build a new deployment for the next run)."""
    feed = deployment.start_feed()
    try:
        yield deployment
    finally:
        feed.cancel()
        await asyncio.gather(feed, return_exceptions=True)
        for replica in deployment.replicas:
            await replica.shutdown()


class LoopClock:
    """The load generator's Clock on the event loop's clock (virtual or real)."""

    def __init__(self):
        self.loop = asyncio.get_running_loop()
        self.start = self.loop.time()

    def now(self) -> float:
        return self.loop.time() - self.start

    async def sleep_until(self, t: float) -> None:
        while (delay := t - self.now()) > 0:
            await asyncio.sleep(delay)


class DriverBackend:
    """The load generator's Backend (bench/loadgen/records.py) over an in-process RequestDriver: no network,
    the router's own accounting (router/accounting.py) for usage and server_timings. Sends token-id prompts
    only (greedy, ignore_eos, n = 1); a request without prompt_ids fails as INVALID_ARGUMENT. Failures are
    recorded with the gRPC status name the router's front doors would answer (router/serving.py error_code)."""

    def __init__(self, driver: RequestDriver, *, name: str = "in-process router"):
        self.driver, self.name = driver, name
        self._ids = itertools.count()

    async def send(self, request: WorkRequest, record: RequestRecord, clock: Clock) -> str:
        record.sent_s = clock.now()
        texts: list[str] = []
        try:
            if request.prompt_ids is None:
                raise ValueError("DriverBackend sends token ids only: this workload gives no prompt_ids")
            params = SamplingParams(max_tokens=request.max_tokens, temperature=0, ignore_eos=True)
            parsed = ParsedRequest(f"bench-{next(self._ids)}", tuple(request.prompt_ids), params, 0,
                                   session_id=request.session_id or "")
            accounting = Accounting(record.sent_s)
            async for progress in self.driver.run(parsed):
                now = clock.now()
                accounting.observe(progress, now)
                first = [o for o in progress.outputs if o.index == 0]
                record.on_tokens(now, sum(len(o.token_ids) for o in first))
                texts += [o.text for o in first]
            record.end_s = clock.now()
            usage = accounting.usage()
            record.prompt_tokens, record.cached_tokens = usage.prompt_tokens, usage.cached_tokens
            record.output_tokens = usage.completion_tokens
            record.server_timings = asdict(accounting.timings(record.end_s))
        except asyncio.CancelledError:
            record.fail("cancelled", "the run ended before the request finished")
            raise
        except Exception as e:
            record.fail(*error_code(e))
        return "".join(texts)

    async def aclose(self) -> None:
        pass


async def serve(deployment: Deployment, conversations: Sequence[Conversation], *, label: str = "simulated",
                quiet: bool = True) -> list[RequestRecord]:
    """One open-loop run of the conversations through the deployment (which is then done), on the loop's clock."""
    async with run_feed(deployment):
        return await open_loop(conversations, DriverBackend(deployment.driver), clock=LoopClock(), label=label,
                               quiet=quiet)


def simulate(shape: Shape, costs: Mapping[str, StepCosts], conversations: Sequence[Conversation],
             slo: SLO | None = None, *, settings: DriverSettings | None = None,
             asked_rate: float | None = None) -> dict:
    """The load generator's summary (bench/loadgen/stats.py summarize: TTFT, ITL, goodput...) of one open-loop
    run of the conversations over a fresh deployment of this shape, on virtual time. Must not be called from a
    running event loop."""
    records = run_virtual(serve(build(shape, costs, settings), conversations))
    return summarize(records, slo, asked_rate=asked_rate)
