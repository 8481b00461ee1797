"""Serving through the cluster: disaggregated (deploy/manifests/local.yaml) against colocated
(local-colocated.yaml, one process with both cores) and against the engine in this process (no Ray, no gRPC: the
floor of what serving costs), in one run on the same requests. The serving path's cost per token is the
colocated cluster's ITL minus the in-process ITL (both one replica of one process, two torch threads, the same
engine settings), the in-process run measured right before and right after the colocated cluster and averaged.

For each: --requests chat requests one at a time (TTFT and mean ITL as the gRPC client sees them; medians), then
the same requests all at once (output tokens/s, TTFT p50/p99). Greedy, ignore_eos, --tokens tokens each; one
untimed warm-up request first (it also opens the UCX connections).

    .venv/bin/python bench/cluster_serving.py [--requests 8] [--tokens 32] [--modes ...] [--profile-tokens 300]

Each cluster starts on a local Ray head this script starts and stops (none may be running). The last line of
output is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


QUESTIONS = ["Write a short story about a lighthouse keeper.", "Explain how a hash map works.",
             "What are the advantages of trains over planes?", "Give me three tips for learning a language."]


def messages(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Request {i}. {QUESTIONS[i % len(QUESTIONS)]}"}]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summarize(sequential: list[tuple[float, float]], concurrent: list[tuple[float, float]], tokens: int,
              wall_s: float) -> dict:
    return {"ttft_ms_p50": 1000 * statistics.median(t for t, _ in sequential),
            "itl_ms_mean": 1000 * statistics.median(i for _, i in sequential),
            "concurrent_tokens_per_s": tokens * len(concurrent) / wall_s,
            "concurrent_ttft_ms_p50": 1000 * percentile([t for t, _ in concurrent], 0.5),
            "concurrent_ttft_ms_p99": 1000 * percentile([t for t, _ in concurrent], 0.99)}


def wait_for_standby_router(cluster, timeout_s: float = 120.0) -> None:
    """Waits until the controller's standby router is warm: it loads the model's tokenizer and imports the
    serving stack in its own process after `up` returns, which would otherwise share the cores with the first
    timed requests."""
    deadline = time.monotonic() + timeout_s
    while cluster.status()["router"].get("standby") != "ready":
        if time.monotonic() > deadline:
            raise RuntimeError(f"the standby router was not ready after {timeout_s:.0f} s")
        time.sleep(0.2)


def cluster_processes() -> dict[int, str]:
    """This machine's Ray processes (the cluster's), pid -> a short name (the actor class for workers)."""
    import psutil

    found = {}
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmdline = p.info["cmdline"] or []
        line = " ".join(cmdline)
        if line.startswith("ray::"):
            found[p.info["pid"]] = cmdline[0].removeprefix("ray::").split(".")[0]
        elif cmdline and Path(cmdline[0]).name in ("raylet", "gcs_server"):
            found[p.info["pid"]] = Path(cmdline[0]).name
    return found


def cpu_per_token(client, tokens: int) -> dict[str, float]:
    """CPU ms per generated token of every cluster process and of this one (the gRPC client) over one greedy
    request of `tokens` tokens at batch 1 (processes of the same name summed)."""
    import psutil

    procs = {pid: psutil.Process(pid) for pid in cluster_processes()} | {0: psutil.Process()}
    names = cluster_processes() | {0: "client (this process)"}

    def used() -> dict[int, float]:
        out = {}
        for pid, proc in procs.items():
            try:
                t = proc.cpu_times()
                out[pid] = t.user + t.system
            except psutil.Error:
                pass
        return out

    before = used()
    client.generate(chat=messages(0), max_tokens=tokens, temperature=0, ignore_eos=True)
    after = used()
    per_token: dict[str, float] = {}
    for pid in before.keys() & after.keys():
        per_token[names[pid]] = per_token.get(names[pid], 0.0) + 1000 * (after[pid] - before[pid]) / tokens
    return dict(sorted(per_token.items(), key=lambda kv: -kv[1]))


def bench_cluster(name: str, requests: int, tokens: int, *, token_channel: bool = True,
                  profile_tokens: int = 0, traced: bool = False) -> dict:
    """traced: every request traced (observability.otlp_endpoint: an OTLP collector in this process); the result
    then counts the spans it received."""
    import ray

    from tandem.bench.otlp_collector import OTLPCollector
    from tandem.cluster import launcher
    from tandem.bench.manifests import manifest_to_measure
    from tandem.cluster.observability_settings import ObservabilitySettings
    from tandem.router.client import TandemClient

    manifest = manifest_to_measure(name)
    collector = OTLPCollector() if traced else None
    observability = ObservabilitySettings(otlp_endpoint=collector.endpoint) if collector else manifest.observability
    manifest = manifest.model_copy(update={"listen": manifest.listen.model_copy(update={"grpc": "127.0.0.1:0"}),
                                           "router": manifest.router.model_copy(update={"token_channel": token_channel}),
                                           "observability": observability})
    cluster = launcher.up(manifest, out=sys.stderr)
    try:
        if not cluster.started_ray:
            raise RuntimeError("a Ray cluster was already running; stop it so that every mode gets the same cores")
        wait_for_standby_router(cluster)
        with TandemClient(cluster.endpoint, timeout_s=600) as client:
            def one(i: int) -> tuple[float, float]:
                r = client.generate(chat=messages(i), max_tokens=tokens, temperature=0, ignore_eos=True)
                assert r.usage.completion_tokens == tokens
                return r.ttft_s, statistics.mean(r.itl_s)

            one(-1)
            sequential = [one(i) for i in range(requests)]
            start = time.perf_counter()
            with ThreadPoolExecutor(requests) as pool:
                concurrent = list(pool.map(one, range(requests, 2 * requests)))
            wall = time.perf_counter() - start
            profile = cpu_per_token(client, profile_tokens) if profile_tokens else None
    finally:
        cluster.shutdown()  # the router and the replicas send their last spans as they stop
        ray.shutdown()
        if collector is not None:
            collector.close()
    result = summarize(sequential, concurrent, tokens, wall)
    if profile is not None:
        result["cpu_ms_per_token"] = profile
    if collector is not None:
        result["spans_received"] = len(collector.spans)
    return result


@functools.cache
def in_process_engine():
    """The engine the in-process runs share: the colocated manifest's settings, two torch threads (the cores the
    clusters get)."""
    import torch

    from tandem.engine.core.llm_engine import LLMEngine
    from tandem.engine.engine_config import EngineConfig
    from tandem.engine.loader import load_model

    torch.set_num_threads(2)
    loaded = load_model(progress=False)
    return loaded, LLMEngine(loaded, EngineConfig(kv_cache_bytes=512 << 20, max_model_len=2048, max_num_seqs=64,
                                                  max_num_batched_tokens=2048))


def bench_in_process(requests: int, tokens: int) -> dict:
    """The engine behind AsyncEngine in this process."""
    from tandem.engine.core.async_engine import AsyncEngine
    from tandem.engine.sampling_params import SamplingParams
    from tandem.router.client import TokenClock

    loaded, engine = in_process_engine()
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)

    async def main():
        async with AsyncEngine(engine) as server:
            async def one(i: int) -> tuple[float, float]:
                clock = TokenClock()
                async for out in server.generate(f"r{i}-{time.monotonic_ns()}", loaded.tokenizer.encode_chat(messages(i)), params):
                    clock.tick(bool(out.token_ids))
                return clock.ttft_s, clock.mean_itl_s

            await one(-1)
            sequential = [await one(i) for i in range(requests)]
            start = time.perf_counter()
            concurrent = await asyncio.gather(*(one(i) for i in range(requests, 2 * requests)))
            return sequential, concurrent, time.perf_counter() - start

    sequential, concurrent, wall = asyncio.run(main())
    return summarize(sequential, list(concurrent), tokens, wall)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--modes", default="disaggregated,colocated,in_process",
                        help="also: parallel (local-parallel.yaml: prefill tp=2, decode pp=2), colocated_ray_streams "
                             "(local-colocated.yaml streaming over Ray calls, router.token_channel: false), "
                             "disaggregated_traced (local.yaml with every request traced to a collector here)")
    parser.add_argument("--profile-tokens", type=int, default=0,
                        help="colocated modes: after the timed requests, one request of this many tokens with the "
                             "CPU per token of every cluster process (cpu_ms_per_token)")
    args = parser.parse_args()
    results = {"requests": args.requests, "tokens": args.tokens}
    runs = {"disaggregated": lambda: bench_cluster("local.yaml", args.requests, args.tokens),
            "disaggregated_traced": lambda: bench_cluster("local.yaml", args.requests, args.tokens, traced=True),
            "colocated": lambda: bench_cluster("local-colocated.yaml", args.requests, args.tokens,
                                               profile_tokens=args.profile_tokens),
            "colocated_ray_streams": lambda: bench_cluster("local-colocated.yaml", args.requests, args.tokens,
                                                           token_channel=False, profile_tokens=args.profile_tokens),
            "parallel": lambda: bench_cluster("local-parallel.yaml", args.requests, args.tokens),
            "in_process": lambda: bench_in_process(args.requests, args.tokens)}
    modes = args.modes.split(",")
    if "colocated" in modes and "in_process" in modes:
        # the floor is measured on both sides of the colocated cluster, so that the host's drift over the run
        # (this machine moves by +-10% from minute to minute) does not land in the difference
        modes = [m for m in modes if m != "in_process"]
        modes.insert(modes.index("colocated"), "in_process")
        modes.insert(max(modes.index(m) for m in modes if m.startswith("colocated")) + 1, "in_process_after")
        runs["in_process_after"] = runs["in_process"]
    if "in_process" in modes:
        # untimed: the in-process engine's first requests run slower (its first prefill chunks of each size), which
        # would pad the floor in the first in-process run and flatter the clusters
        print("== in-process warm-up (untimed)", file=sys.stderr, flush=True)
        runs["in_process"]()
    for mode in modes:
        print(f"== {mode}", file=sys.stderr, flush=True)
        results[mode] = runs[mode]()
        print(f"{mode}: {json.dumps(results[mode])}", file=sys.stderr, flush=True)
    if "disaggregated" in results and "colocated" in results:
        d, c = results["disaggregated"], results["colocated"]
        results["ratios_disaggregated_to_colocated"] = {
            key: d[key] / c[key] for key in ("ttft_ms_p50", "itl_ms_mean", "concurrent_tokens_per_s")}
    if "disaggregated" in results and "disaggregated_traced" in results:
        d, t = results["disaggregated"], results["disaggregated_traced"]
        results["ratios_traced_to_untraced"] = {
            key: t[key] / d[key] for key in ("ttft_ms_p50", "itl_ms_mean", "concurrent_tokens_per_s")}
    if "colocated" in results and "in_process" in results:
        floor = [results[m]["itl_ms_mean"] for m in ("in_process", "in_process_after") if m in results]
        results["serving_path_ms_per_token"] = results["colocated"]["itl_ms_mean"] - statistics.mean(floor)
        if "colocated_ray_streams" in results:
            results["serving_path_ms_per_token_ray_streams"] = (results["colocated_ray_streams"]["itl_ms_mean"]
                                                                 - statistics.mean(floor))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
