"""Disaggregated against colocated serving at 8-32 replicas per pool, in one process: the router's real request
driver, routing and KV feed over the batching mock replicas (router/mocks/batching.py), whose step costs are
measured on the real embedded model here (calibrate). A library for the benchmark that runs the load generator
(bench/loadgen) over it: build_deployment() builds either deployment, run_feed() runs its KV feed around a run,
and DriverBackend is the load generator's Backend over the deployment's driver.

The two deployments get the same engines: N prefill + N decode replicas (disaggregated) against 2N colocated
replicas, each of which prefills in chunks inside the step that also decodes its running sequences.

    costs = calibrate()
    deployment = build_deployment("colocated", 16, costs)
    async with run_feed(deployment):
        records = await open_loop(conversations, DriverBackend(deployment.driver))
"""

from __future__ import annotations

import asyncio
import itertools
import statistics
import time
from contextlib import asynccontextmanager
from dataclasses import asdict
from typing import AsyncIterator, Callable, NamedTuple, Sequence

from tandem.bench.loadgen.records import Clock, RequestRecord, WorkRequest
from tandem.cluster.hardware_profile import UCX_LOOPBACK_BYTES_PER_S
from tandem.engine.sampling_params import SamplingParams
from tandem.router.accounting import Accounting
from tandem.router.driver_settings import DriverSettings
from tandem.router.lifecycle import RequestDriver
from tandem.router.mocks.batching import BLOCK_SIZE, BatchedDecode, BatchedPrefill, StepCosts
from tandem.router.replicas import Replica
from tandem.router.request_parsing import ParsedRequest
from tandem.router.routing import RoutingSettings
from tandem.router.serving import error_code

MODES = ("disaggregated", "colocated")


def _linear_fit(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through (xs, ys)."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope


def calibrate(threads: int = 1, *, prompt_tokens: int = 1024, batch_sizes: Sequence[int] = (1, 4, 16),
              decode_context: int = 64, decode_steps: int = 6, repeats: int = 2,
              transfer_bytes_per_s: float = UCX_LOOPBACK_BYTES_PER_S, max_num_batched_tokens: int = 2048,
              max_num_seqs: int = 128, loaded=None) -> StepCosts:
    """StepCosts of the embedded model on this machine, with `threads` torch threads (one replica's share):
    - decode: the median step time of len(batch_sizes) batches of concurrent sequences (decode_context prompt
      tokens each), fitted as step_s + decode_token_s * batch;
    - prefill_token_s: (one prompt_tokens-long prefill step - step_s) / prompt_tokens, best of `repeats`;
    - kv_bytes_per_token: 2 (K, V) * layers * KV heads * head_dim * the KV dtype's bytes.
    The budgets (max_num_batched_tokens, max_num_seqs) and transfer_bytes_per_s are passed through. loaded: the
    model (engine/loader LoadedModel; None: load the embedded one, a few seconds). Computes 1 + repeats prompts
    and sum(batch_sizes) short ones (about 30 s on a 2-core CPU with the defaults); restores the torch thread
    count. Raises ValueError for fewer than two distinct batch sizes (the fit needs two)."""
    if len(set(batch_sizes)) < 2 or min(batch_sizes) < 1:
        raise ValueError(f"batch_sizes must hold at least two different sizes >= 1, got {tuple(batch_sizes)}")
    import torch

    from tandem.engine.core.llm_engine import LLMEngine
    from tandem.engine.engine_config import EngineConfig
    from tandem.engine.loader import load_model

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        loaded = loaded or load_model(progress=False)
        mc = loaded.config
        longest = max(prompt_tokens, decode_context) + decode_steps + 8
        engine = LLMEngine(loaded, EngineConfig(
            max_model_len=longest, num_kv_blocks=max(batch_sizes) * -(-longest // BLOCK_SIZE) + 8,
            max_num_batched_tokens=max(prompt_tokens, decode_context * max(batch_sizes)),
            max_num_seqs=max(batch_sizes), enable_prefix_caching=False))
        ids = itertools.count()

        def prompt(n: int) -> list[int]:
            seed = next(ids)
            return [100 + (seed * 7919 + i * 37) % 20000 for i in range(n)]

        def timed_step() -> float:
            start = time.perf_counter()
            engine.step()
            return time.perf_counter() - start

        def add(n: int, max_tokens: int) -> None:
            engine.add_request(f"calibrate-{next(ids)}", prompt(n),
                               SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))

        try:
            add(64, 2)  # warm-up
            while engine.has_unfinished_requests():
                engine.step()
            decode_times = []
            for batch in batch_sizes:
                for _ in range(batch):
                    add(decode_context, decode_steps + 1)
                engine.step()  # every prompt at once, and each one's first token
                decode_times.append(statistics.median(timed_step() for _ in range(decode_steps)))
                if engine.has_unfinished_requests():
                    raise RuntimeError("calibration: the decode batch did not finish when expected")
            step_s, decode_token_s = _linear_fit(batch_sizes, decode_times)
            step_s, decode_token_s = max(0.0, step_s), max(0.0, decode_token_s)
            prefill = []
            for _ in range(repeats):
                add(prompt_tokens, 1)
                prefill.append(timed_step())
        finally:
            engine.shutdown()
        dtype_bytes = torch.empty((), dtype=loaded.dtype).element_size()
        kv_bytes = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * dtype_bytes
        return StepCosts(step_s=step_s, decode_token_s=decode_token_s,
                         prefill_token_s=max(0.0, min(prefill) - step_s) / prompt_tokens,
                         kv_bytes_per_token=kv_bytes, transfer_bytes_per_s=transfer_bytes_per_s,
                         max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs)
    finally:
        torch.set_num_threads(previous)


class Deployment(NamedTuple):
    """driver: the router's request driver over the replicas (driver.settings.mode says which deployment).
    start_feed(): starts the router's KV feed (polling every replica's KV events and free blocks) as a task on the
    running loop; cancel it when done (run_feed does)."""

    driver: RequestDriver
    replicas: list[BatchedPrefill | BatchedDecode]
    start_feed: Callable[[], asyncio.Task]


def build_deployment(mode: str, replicas_per_pool: int, costs: StepCosts, policy: str = "cache_aware", *,
                     routing: RoutingSettings | None = None, settings: DriverSettings | None = None) -> Deployment:
    """Disaggregated: replicas_per_pool prefill + replicas_per_pool decode replicas. Colocated: 2 *
    replicas_per_pool decode replicas that prefill locally (the same number of engines). routing: the router's
    settings (default: `policy` with the manifest's weights); settings: the driver's (its mode and routing are
    replaced by these). Raises ValueError for an unknown mode or fewer than one replica per pool."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    if replicas_per_pool < 1:
        raise ValueError(f"replicas_per_pool must be at least 1, got {replicas_per_pool}")
    routing = routing or RoutingSettings(policy=policy)
    settings = DriverSettings(**{**vars(settings or DriverSettings()), "mode": mode, "routing": routing})
    if mode == "disaggregated":
        prefill = [BatchedPrefill(f"prefill-{i}", costs) for i in range(replicas_per_pool)]
        decode = [BatchedDecode(f"decode-{i}", costs) for i in range(replicas_per_pool)]
    else:
        prefill, decode = [], [BatchedDecode(f"colocated-{i}", costs) for i in range(2 * replicas_per_pool)]
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
