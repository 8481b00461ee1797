"""Disaggregated against colocated serving at 8-32 replicas per pool, in one process: the router's real request
driver, routing and KV feed over the batching mock replicas (router/mocks/batching.py), whose step costs are
measured on the real embedded model here (calibrate). A library for the benchmark that runs the load generator
(bench/loadgen) over it: build_deployment() builds either deployment (cluster/simulation.py's build, whose run_feed
runs its KV feed around a run and whose DriverBackend is the load generator's Backend over its driver).

The two deployments get the same engines: N prefill + N decode replicas (disaggregated) against 2N colocated
replicas, each of which prefills in chunks inside the step that also decodes its running sequences.

    costs = calibrate()
    records = await serve(build_deployment("colocated", 16, costs), conversations)  # cluster/simulation.py
"""

from __future__ import annotations

import itertools
import statistics
import time
from typing import Sequence

from tandem.cluster.hardware_profile import UCX_LOOPBACK_BYTES_PER_S
from tandem.cluster.simulation import Deployment, Shape, build
from tandem.engine.sampling_params import SamplingParams
from tandem.router.driver_settings import DriverSettings
from tandem.router.mocks.batching import BLOCK_SIZE, StepCosts
from tandem.router.routing import RoutingSettings



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


def build_deployment(mode: str, replicas_per_pool: int, costs: StepCosts, policy: str = "cache_aware", *,
                     routing: RoutingSettings | None = None, settings: DriverSettings | None = None) -> Deployment:
    """Disaggregated: replicas_per_pool prefill + replicas_per_pool decode replicas. Colocated: 2 *
    replicas_per_pool decode replicas that prefill locally (the same number of engines), every one priced by
    `costs` (cluster/simulation.py builds them). routing: the router's settings (default: `policy` with the
    manifest's weights); settings: the driver's (its mode and routing are replaced by these). Raises ValueError
    for an unknown mode or fewer than one replica per pool."""
    if replicas_per_pool < 1:
        raise ValueError(f"replicas_per_pool must be at least 1, got {replicas_per_pool}")
    routing = routing or RoutingSettings(policy=policy)
    settings = DriverSettings(**{**vars(settings or DriverSettings()), "routing": routing})
    shape = (Shape(mode, replicas_per_pool, replicas_per_pool) if mode == "disaggregated"
             else Shape(mode, 0, 2 * replicas_per_pool))
    return build(shape, {"prefill": costs, "decode": costs}, settings)
