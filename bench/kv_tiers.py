"""KV tiers on the local cluster: `tandem bench --workload sessions` (multi-turn chats; or shared-prefix: groups of
requests sharing a long prefix) against the colocated manifest with a small KV pool, tiers off against a host tier
(and a host + disk tier), one run, the same seed and rate. The sessions' working set is several times the pool, so
without tiers each turn's history was evicted and is computed again; with them it is copied back.

    .venv/bin/python bench/kv_tiers.py [--pool-blocks 128] [--sessions 8] [--turns 3] [--rate 0.5] \
        [--modes off,host,disk]

Each mode starts the cluster on a local Ray head this script starts and stops (none may be running). The last line
is one JSON object: per mode, prefix hit rate, TTFT p50/p90, ITL p99 and the replica's tier counters; and the
ratios against tiers off.

    .venv/bin/python bench/kv_tiers.py --modes pulls-off,pulls-on --output fixed:96 [...]

runs the workload on the disaggregated local cluster (deploy/manifests/local.yaml: a prefill and a decode
replica, no tiers) with prefix pulls across replicas off (router.prefix_pull_min_blocks: 0) and on (4): a
session's next turn pulls the last turn's blocks, its answer's included, from the decode replica.

    .venv/bin/python bench/kv_tiers.py --engine [--history 800] [--new 128] [--repeats 3]

measures one turn in the engine alone instead (LLMEngine in this process, two torch threads, no serving path and no
other sessions): a history of --history tokens computed, evicted from the pool by another prompt, then the next
turn (the history and --new tokens) timed to its first token, tiers off / host / disk, median of --repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

MANIFEST = Path(__file__).resolve().parents[1] / "deploy" / "manifests" / "local-colocated.yaml"
DISAGGREGATED = MANIFEST.with_name("local.yaml")
BLOCK_BYTES = 737_280  # one block of the embedded model's float32 KV: 30 layers x K,V x 3 heads x 16 x 64 x 4 B


def tiers_of(mode: str, disk: Path) -> dict | None:
    if mode == "off":
        return None
    if mode == "host":
        return {"host_bytes": 2 << 30}
    return {"host_bytes": 64 * BLOCK_BYTES, "disk_path": str(disk), "disk_bytes": 4 << 30}  # most blocks on disk


def run_mode(mode: str, args, disk: Path) -> dict:
    import ray

    from tandem.cluster import launcher
    from tandem.bench.manifests import manifest_to_measure

    pulls = mode.startswith("pulls-")
    manifest = manifest_to_measure((DISAGGREGATED if pulls else MANIFEST).name)
    pool = manifest.pools.decode
    engine = pool.engine.model_copy(update={"speculative": None, "kv_tiers": None} if pulls else {
        "kv_cache_bytes": args.pool_blocks * BLOCK_BYTES, "speculative": None, "kv_tiers": None})
    if pulls:
        manifest = manifest.model_copy(update={"router": manifest.router.model_copy(
            update={"prefix_pull_min_blocks": 4 if mode == "pulls-on" else 0})})
    elif (tiers := tiers_of(mode, disk)) is not None:
        from tandem.cluster.engine_settings import KVTiersSettings

        engine = engine.model_copy(update={"kv_tiers": KVTiersSettings(**tiers)})
    manifest = manifest.model_copy(update={
        "listen": manifest.listen.model_copy(update={"grpc": "127.0.0.1:0", "http": None}),
        "pools": manifest.pools.model_copy(update={"decode": pool.model_copy(update={"engine": engine})})})
    cluster = launcher.up(manifest, out=sys.stderr)
    try:
        if not cluster.started_ray:
            raise RuntimeError("a Ray cluster was already running; stop it so that every mode gets the same cores")
        with tempfile.TemporaryDirectory() as out:
            command = [str(Path(sys.executable).parent / "tandem"), "bench", "--target", cluster.endpoint,
                       "--workload", args.workload, "--turns", str(args.turns), "--think-time", str(args.think_time),
                       "--prefix-groups", str(args.prefix_groups), "--prefix-len", str(args.prefix_len),
                       "--rate", str(args.rate), "--num-requests", str(args.sessions), "--input", args.input,
                       "--output", args.output, "--seed", str(args.seed), "--quiet", "--out", out]
            done = subprocess.run(command, capture_output=True, text=True, timeout=3600)
            if done.returncode:
                raise RuntimeError(f"tandem bench failed: {done.stderr[-2000:]}")
            summary = json.loads(done.stdout.strip().splitlines()[-1])
        replicas = cluster.status()["replicas"]
        tier_stats = replicas[0].get("kv_tiers") if replicas else None
        pull_counts = _pull_counts(cluster.status()) if pulls else None
    finally:
        cluster.shutdown()
        ray.shutdown()
    return {"completed": summary["completed"], "failed": summary["failed"],
            "prefix_hit_rate": summary["prefix_hit_rate"], "ttft_p50_ms": summary["ttft_ms"]["p50"],
            "ttft_p90_ms": summary["ttft_ms"]["p90"], "itl_p99_ms": summary["itl_ms"]["p99"],
            "tiers": tier_stats, "pulls": pull_counts}


def _pull_counts(status: dict) -> dict:
    """The prefill replica's prompt tokens found cached, and its prefix cache, as `tandem status` reports them."""
    prefill = [r for r in status["replicas"] if r.get("pool") == "prefill"]
    return {"prefill_hit_rate": prefill[0].get("prefix_hit_rate") if prefill else None}


def engine_turn(args) -> dict:
    import random
    import statistics
    import time

    import torch

    from tandem.engine.core.llm_engine import LLMEngine
    from tandem.engine.engine_config import EngineConfig, KVTiersConfig
    from tandem.engine.loader import load_model
    from tandem.engine.sampling_params import SamplingParams

    torch.set_num_threads(2)
    loaded = load_model(progress=False)
    rng = random.Random(args.seed)
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)

    def ids(n: int) -> list[int]:
        return [rng.randrange(1000, 40000) for _ in range(n)]

    def first_token_s(engine: LLMEngine, prompt: list[int]) -> float:
        start = time.perf_counter()
        engine.add_request(f"r{rng.random()}", prompt, params)
        while engine.has_unfinished_requests():
            engine.step()
        return time.perf_counter() - start

    pool = 2 * -(-(args.history + args.new) // 16)
    results = {}
    with tempfile.TemporaryDirectory() as disk:
        for mode in ("off", "host", "disk"):
            tiers = {"off": None, "host": KVTiersConfig(host_bytes=1 << 30),
                     "disk": KVTiersConfig(host_bytes=4 * BLOCK_BYTES, disk_path=disk, disk_bytes=1 << 30)}[mode]
            with LLMEngine(loaded, EngineConfig(num_kv_blocks=pool, max_model_len=4096, kv_tiers=tiers)) as engine:
                first_token_s(engine, ids(64))  # warm-up
                times = []
                for _ in range(args.repeats):
                    history = ids(args.history)
                    first_token_s(engine, history)
                    first_token_s(engine, ids(pool * 16 - 32))  # evicts the history from the pool
                    times.append(first_token_s(engine, history + ids(args.new)))
                results[mode] = {"ttft_ms": 1000 * statistics.median(times),
                                 "tokens_from_tiers": engine.stats().num_prompt_tokens_from_tiers}
    return {"results": results, "ratios": {mode: results["off"]["ttft_ms"] / results[mode]["ttft_ms"]
                                           for mode in ("host", "disk")}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pool-blocks", type=int, default=128, help="the replica's KV pool, in blocks of 16 tokens")
    p.add_argument("--workload", choices=["sessions", "shared-prefix"], default="sessions")
    p.add_argument("--sessions", type=int, default=8, help="sessions (shared-prefix: requests)")
    p.add_argument("--prefix-groups", type=int, default=8, help="shared-prefix: groups")
    p.add_argument("--prefix-len", type=int, default=1024, help="shared-prefix: tokens of each group's prefix")
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--think-time", type=float, default=2.0)
    p.add_argument("--rate", type=float, default=0.5, help="sessions started per second")
    p.add_argument("--input", default="fixed:384", help="tokens of each user message")
    p.add_argument("--output", default="fixed:32", help="tokens of each answer")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--modes", default="off,host,disk", help="off, host, disk (tiers on the colocated cluster); "
                   "pulls-off, pulls-on (prefix pulls on the disaggregated one)")
    p.add_argument("--engine", action="store_true", help="one turn in the engine alone (see above)")
    p.add_argument("--history", type=int, default=800)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    flags = sorted({f for line in open("/proc/cpuinfo") if line.startswith("flags")
                    for f in line.split(":")[1].split() if f.startswith(("avx", "amx"))})
    machine = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "flags": flags}
    if args.engine:
        print(json.dumps({"machine": machine, "config": {"history": args.history, "new": args.new,
                                                         "repeats": args.repeats}} | engine_turn(args)))
        return
    results = {}
    with tempfile.TemporaryDirectory() as disk:
        for mode in args.modes.split(","):
            print(f"kv_tiers bench: tiers {mode}", file=sys.stderr)
            results[mode] = run_mode(mode, args, Path(disk))
    base = results.get("off") or results.get("pulls-off")
    ratios = {}
    if base:
        for mode, r in results.items():
            if r is not base:
                ratios[mode] = {"ttft_p50_off_over_on": base["ttft_p50_ms"] / r["ttft_p50_ms"],
                                "ttft_p90_off_over_on": base["ttft_p90_ms"] / r["ttft_p90_ms"],
                                "itl_p99_on_over_off": r["itl_p99_ms"] / base["itl_p99_ms"]}
    if args.workload == "sessions":
        working_set = args.sessions * args.turns * (int(args.input.split(":")[1]) + int(args.output.split(":")[1]))
    else:
        working_set = args.prefix_groups * args.prefix_len
    print(json.dumps({"machine": machine,
                      "config": vars(args) | {"working_set_over_pool": working_set / (16 * args.pool_blocks)},
                      "results": results, "ratios": ratios}))


if __name__ == "__main__":
    main()
