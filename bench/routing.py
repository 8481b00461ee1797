"""Cache-aware routing against the baselines, and what one routing decision costs.

Part 1, policies. The router's real request driver, routing, prefix index and KV feed (polling every 50 ms, as
in a cluster) drive --prefill 4 prefill replicas and 4 decode replicas of the mock engine
(router/mocks/replicas.py). A mock prefill replica computes one prompt at a time and takes
--prefill-us microseconds per uncached prompt token; its prefix cache holds --cache-blocks blocks (LRU, the
engine's hashing, real KV events). By default the per-token cost is measured first on the real embedded model in
this process (one prefill of a --system-tokens-long prompt, 2 torch threads), so the simulated replicas
prefill at this machine's speed. Workload: --groups groups of requests; each group shares a --system-tokens
system prompt, followed by a unique --user-tokens question; --clients closed-loop clients send --requests
requests in all, each to a random group, --max-tokens output tokens each (decode --decode-ms per token). The
same seeded workload runs under cache_aware, least_loaded and round_robin in one run; each reports the prefix
hit rate (cached / prompt tokens over all requests), TTFT p50/p99 and throughput (requests/s).

Part 2, decision cost. Routing alone (hashing the prompt, the index lookup, scoring every replica, choosing
prefill and decode replicas, recording the decision) against --replicas prefill and as many decode replicas
with random loads, and an index holding --indexed-blocks blocks; p50/p99 over --decisions decisions.

    .venv/bin/python bench/routing.py [--requests 240] [--no-calibrate --prefill-us 400] [--queued-weight 1.0]

The last line of output is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time

from tandem.engine.sampling_params import SamplingParams
from tandem.router.driver_settings import DriverSettings
from tandem.router.lifecycle import RequestDriver
from tandem.router.mocks.replicas import MockDecode, MockPrefill
from tandem.router.policy import ReplicaLoad, RoutingWeights
from tandem.router.replicas import Replica
from tandem.router.request_parsing import ParsedRequest
from tandem.router.routing import Routing, RoutingSettings

POLICIES = ("cache_aware", "least_loaded", "round_robin")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def calibrate(system_tokens: int) -> float:
    """Seconds per prompt token of one prefill on the real embedded model here (2 torch threads)."""
    import torch

    from tandem.engine.core.generator import Generator
    from tandem.engine.loader import load_model

    torch.set_num_threads(2)
    loaded = load_model(progress=False)
    prompt = [(i * 37) % 20000 + 100 for i in range(system_tokens)]
    params = SamplingParams(max_tokens=1, temperature=0)
    with Generator(loaded) as generator:
        generator.generate(prompt[:64], params)  # warm-up
        times = []
        for _ in range(3):
            start = time.perf_counter()
            generator.generate(prompt, params)
            times.append(time.perf_counter() - start)
    return min(times) / system_tokens


def weights(args) -> RoutingWeights:
    """The manifest's default weights, or --queued-weight for queued prefill tokens."""
    if args.queued_weight is None:
        return RoutingWeights()
    return RoutingWeights(queued_prefill_tokens=args.queued_weight)


def workload(args) -> list[tuple[int, tuple[int, ...]]]:
    rng = random.Random(args.seed)
    systems = [tuple(rng.randrange(100, 30000) for _ in range(args.system_tokens)) for _ in range(args.groups)]
    requests = []
    for _ in range(args.requests):
        group = rng.randrange(args.groups)
        requests.append((group, systems[group] + tuple(rng.randrange(100, 30000) for _ in range(args.user_tokens))))
    return requests


async def run_policy(policy: str, requests, args, per_token_s: float) -> dict:
    prefill = [MockPrefill(f"prefill-{i}", per_token_s=per_token_s, blocks=args.cache_blocks)
               for i in range(args.prefill)]
    decode = [MockDecode(f"decode-{i}", step_s=args.decode_ms / 1000) for i in range(args.prefill)]
    driver = RequestDriver([Replica(p.name, "prefill", p) for p in prefill],
                           [Replica(d.name, "decode", d) for d in decode],
                           DriverSettings(routing=RoutingSettings(policy=policy, weights=weights(args))),
                           block_size=16)
    feed = asyncio.create_task(driver.feed.run(driver.replicas, 0.05))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    queue = list(enumerate(requests))
    ttfts: list[float] = []

    async def client() -> None:
        while queue:
            i, (group, prompt) = queue.pop(0)
            start = time.perf_counter()
            first = None
            async for progress in driver.run(ParsedRequest(f"r{i}", prompt, params, 0)):
                if first is None and any(o.token_ids for o in progress.outputs):
                    first = time.perf_counter() - start
            ttfts.append(first)

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(args.clients)))
    wall = time.perf_counter() - start
    feed.cancel()
    prompt_tokens = sum(len(p) for _, p in requests)
    cached = sum(sum(p.cached_tokens.values()) for p in prefill)
    return {"hit_rate": cached / prompt_tokens, "ttft_ms_p50": 1000 * percentile(ttfts, 0.5),
            "ttft_ms_p99": 1000 * percentile(ttfts, 0.99), "requests_per_s": len(requests) / wall,
            "requests_per_prefill_replica": [len(p.prefilled) for p in prefill]}


def decision_cost(args) -> dict:
    """p50/p99 of Routing.plan + choosing the decode replica + record, over random loads and a full index."""
    rng = random.Random(args.seed)
    routing = Routing(RoutingSettings(), block_size=16)
    prefill = [ReplicaLoad(f"prefill-{i}", in_flight=rng.randrange(4), queued_prefill_tokens=rng.randrange(4096))
               for i in range(args.replicas)]
    decode = [ReplicaLoad(f"decode-{i}", in_flight=rng.randrange(32), kv_blocks_free=rng.randrange(10_000))
              for i in range(args.replicas)]
    # The index: chains of 64 blocks (1024-token prefixes), each held by 1-3 prefill replicas.
    prefixes = []
    index = routing.indexes["prefill"]
    from tandem.engine.kv.kv_events import BlockStored
    from tandem.engine.kv.prefix_cache import block_hashes

    while len(index) < args.indexed_blocks:
        tokens = tuple(rng.randrange(100, 30000) for _ in range(1024))
        prefixes.append(tokens)
        events = [BlockStored(h, None, ()) for h in block_hashes(tokens, 16)]
        for holder in rng.sample(prefill, rng.randint(1, 3)):
            index.apply(holder.name, events)
    costs = []
    for i in range(args.decisions):
        prompt = rng.choice(prefixes) + tuple(rng.randrange(100, 30000) for _ in range(args.user_tokens))
        start = time.perf_counter()
        plan = routing.plan(prompt, prefill=prefill, decode=decode)
        chosen_decode = next(plan.decode)
        routing.record(plan, prefill=plan.prefill.name, decode=chosen_decode.name)
        costs.append(time.perf_counter() - start)
    return {"replicas_per_pool": args.replicas, "indexed_blocks": len(index), "prompt_tokens": 1024 + args.user_tokens,
            "decision_us_p50": 1e6 * percentile(costs, 0.5), "decision_us_p99": 1e6 * percentile(costs, 0.99),
            "decision_us_max": 1e6 * max(costs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefill", type=int, default=4, help="prefill replicas (and as many decode replicas)")
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--system-tokens", type=int, default=1024)
    parser.add_argument("--user-tokens", type=int, default=48)
    parser.add_argument("--requests", type=int, default=240)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--decode-ms", type=float, default=5.0)
    parser.add_argument("--cache-blocks", type=int, default=320, help="prefix cache per prefill replica, blocks")
    parser.add_argument("--prefill-us", type=float, default=None, help="per uncached token (default: measured)")
    parser.add_argument("--no-calibrate", action="store_true")
    parser.add_argument("--queued-weight", type=float, default=None,
                        help="cache_aware's weight of a queued prefill token (default: the manifest's 0.5)")
    parser.add_argument("--replicas", type=int, default=1000, help="per pool, for the decision cost")
    parser.add_argument("--indexed-blocks", type=int, default=100_000)
    parser.add_argument("--decisions", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    if args.prefill_us is not None or args.no_calibrate:
        per_token_s = (args.prefill_us or 400.0) / 1e6
        source = "given"
    else:
        print(f"measuring the embedded model's prefill ({args.system_tokens} tokens)...", file=sys.stderr)
        per_token_s = calibrate(args.system_tokens)
        source = "measured on the embedded model"
    print(f"simulated prefill: {1e6 * per_token_s:.0f} us per uncached token ({source})", file=sys.stderr)
    requests = workload(args)
    results: dict = {"prefill_us_per_token": 1e6 * per_token_s, "prefill_cost": source,
                     "config": {k: v for k, v in vars(args).items() if k not in ("no_calibrate",)}}
    for policy in POLICIES:
        results[policy] = asyncio.run(run_policy(policy, requests, args, per_token_s))
        r = results[policy]
        print(f"{policy:>13}: hit rate {100 * r['hit_rate']:5.1f}%  TTFT p50 {r['ttft_ms_p50']:8.1f} ms  "
              f"p99 {r['ttft_ms_p99']:8.1f} ms  {r['requests_per_s']:6.2f} req/s  "
              f"per replica {r['requests_per_prefill_replica']}", file=sys.stderr)
    ca, rr = results["cache_aware"], results["round_robin"]
    results["cache_aware_vs_round_robin"] = {"hit_rate_x": ca["hit_rate"] / max(rr["hit_rate"], 1e-9),
                                             "ttft_p50_x": rr["ttft_ms_p50"] / ca["ttft_ms_p50"],
                                             "ttft_p99_x": rr["ttft_ms_p99"] / ca["ttft_ms_p99"],
                                             "throughput_x": ca["requests_per_s"] / rr["requests_per_s"]}
    print("measuring the decision cost...", file=sys.stderr)
    results["decision"] = decision_cost(args)
    d = results["decision"]
    print(f"decision against {d['replicas_per_pool']} replicas per pool, {d['indexed_blocks']} indexed blocks: "
          f"p50 {d['decision_us_p50']:.0f} us, p99 {d['decision_us_p99']:.0f} us", file=sys.stderr)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
